#!/usr/bin/env bash
# The one command to run on each node of a replication run. See --help.
# Its own tool, longer than a wrapper: it runs before any Python (on a bare node, under SLURM or ssh),
# so its options, environment fallbacks and the torchrun line are spelled out in shell here.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/launch_node.sh --experiment NAME [options] [-- extra hydra overrides]

Starts this node's part of an experiment (configs/experiment/NAME.yaml):
  DDP and synchronous DiLoCo: torchrun with the experiment's --nnodes / --nproc_per_node, this node's
    --node_rank and a c10d rendezvous at --rdzv (node 0's address; not needed on a single node).
  DumbDiLoCo: one node in the given --role (master or worker) with its --node-id, --repo-id (a Hub repo
    org/name or a shared directory) and data --shard: one process, or torchrun with the experiment's
    --nproc_per_node on this machine (DDP inside the node); no rendezvous between nodes.

Options (each also read from the environment variable in brackets):
  --experiment NAME    e.g. 150m/diloco_8w_h500, 1b/ddp, tiny/diloco_fp32          [EXPERIMENT]
  --node-rank R        this node's rank, 0..nodes-1 (default 0; SLURM_NODEID if set) [NODE_RANK]
  --nodes N            run on N nodes instead of the experiment's launch.nodes (e.g. 150m/ddp_1x on 2
                       nodes; the same as `-- launch.nodes=N`)                    [NODES]
  --rdzv HOST:PORT     rendezvous endpoint = node 0 (required when nodes > 1)       [RDZV_ENDPOINT]
  --role ROLE          DumbDiLoCo: master | worker                                  [ROLE]
  --node-id ID         DumbDiLoCo: unique, path-safe node id                        [NODE_ID]
  --repo-id REPO       DumbDiLoCo: org/name (Hub, needs HF_TOKEN) or /shared/path    [REPO_ID]
  --shard I            DumbDiLoCo: this node's data shard, 0..nodes-1 (the master's is 0); a worker
                       needs it, or --node-rank I, which it then equals             [SHARD]
  --cpu                run on CPU with gloo (the tiny family; no GPU check)         [CPU=1]
  --dry-run            check the config as the real run would, print what would run, start nothing
                                                                                    [DRY_RUN=1]
  -h, --help           this text

The config (experiment, options and the overrides after --) is validated before anything starts; a
refusal is one line and exit 2. Ctrl+C or SIGTERM: every rank finishes its step, writes a checkpoint
and the launch exits 130; run the same command again to resume.
Logs go to <out_dir>/<run_name>/launch-node<R>.log as well as the terminal.
EOF
}

die() { echo "launch_node.sh: error: $*" >&2; exit 2; }

cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[[ -x $PY ]] || PY=python3

EXPERIMENT=${EXPERIMENT:-}; RDZV_ENDPOINT=${RDZV_ENDPOINT:-}; NODES=${NODES:-}
NODE_RANK_GIVEN=${NODE_RANK:+1}${SLURM_NODEID:+1}; NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
ROLE=${ROLE:-}; NODE_ID=${NODE_ID:-}; REPO_ID=${REPO_ID:-}; SHARD=${SHARD:-}
CPU=${CPU:-0}; DRY_RUN=${DRY_RUN:-0}; EXTRA=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --experiment) EXPERIMENT=${2:?}; shift 2 ;;
    --node-rank) NODE_RANK=${2:?}; NODE_RANK_GIVEN=1; shift 2 ;;
    --nodes) NODES=${2:?}; shift 2 ;;
    --rdzv) RDZV_ENDPOINT=${2:?}; shift 2 ;;
    --role) ROLE=${2:?}; shift 2 ;;
    --node-id) NODE_ID=${2:?}; shift 2 ;;
    --repo-id) REPO_ID=${2:?}; shift 2 ;;
    --shard) SHARD=${2:?}; shift 2 ;;
    --cpu) CPU=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done

[[ -n $EXPERIMENT ]] || die "--experiment is required (see --help)"
if [[ -n $NODES ]]; then
  [[ $NODES =~ ^[1-9][0-9]*$ ]] || die "--nodes must be a positive number, got '$NODES'"
  EXTRA=("launch.nodes=$NODES" "${EXTRA[@]}")
fi
vars=$("$PY" scripts/plan.py vars "$EXPERIMENT" "${EXTRA[@]}" 2>&1) || die "${vars#error: }"
eval "$vars"
[[ $NODE_RANK =~ ^[0-9]+$ ]] || die "--node-rank must be a number, got '$NODE_RANK'"

# ---------------------------------------------------------------------------- environment
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / EXP_GPUS_PER_NODE > 0 ? $(nproc) / EXP_GPUS_PER_NODE : 1 ))}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}  # a dead rank fails the job, not hangs it
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}  # a stopped rank's last step + checkpoint
export TOKENIZERS_PARALLELISM=false

if [[ $CPU == 1 ]]; then
  DEVICE=device=cpu
else
  DEVICE=device=cuda
  if [[ $DRY_RUN != 1 ]]; then
    command -v nvidia-smi >/dev/null 2>&1 || die "no GPU on this node (nvidia-smi not found); use --cpu for the tiny family"
    ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    (( ngpu >= EXP_GPUS_NEEDED )) || die "$EXPERIMENT needs $EXP_GPUS_NEEDED GPUs on this node, found $ngpu"
  fi
fi

RUN_NAME=$EXP_RUN_NAME
if [[ $EXP_MODE == dumb_diloco ]]; then
  [[ $ROLE == master || $ROLE == worker ]] || die "DumbDiLoCo needs --role master or --role worker"
  [[ -n $NODE_ID ]] || die "DumbDiLoCo needs --node-id (unique, path-safe)"
  [[ $NODE_ID =~ ^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$ && $NODE_ID != *..* ]] || die "--node-id '$NODE_ID' is not path-safe (letters, digits, . _ -)"
  REPO_ID=${REPO_ID:-$EXP_REPO_ID}
  [[ -n $REPO_ID ]] || die "DumbDiLoCo needs --repo-id (org/name on the Hub, or a shared directory)"
  if [[ $REPO_ID =~ ^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+$ && $REPO_ID != ./* && $REPO_ID != /* ]]; then
    token_override=""  # distributed.token=... after `--` (works, with the trainer's warning)
    for a in "${EXTRA[@]}"; do [[ $a != distributed.token=?* ]] || token_override=1; done
    token_file=${HF_TOKEN_PATH:-${HF_HOME:-$HOME/.cache/huggingface}/token}
    [[ -n ${HF_TOKEN:-} || -n $token_override || -f $token_file ]] \
      || die "repo $REPO_ID is on the Hugging Face Hub: set HF_TOKEN (a write token of a dedicated account)"
  fi
  # the node's data shard and its label (launch-node<R>.log) are one number: given, or the node rank
  if [[ -z $SHARD ]]; then
    [[ $ROLE == master || -n $NODE_RANK_GIVEN ]] \
      || die "a DumbDiLoCo worker needs its data shard: --shard I (1..$((EXP_WORKERS - 1)); the master's is 0) or --node-rank I"
    SHARD=$NODE_RANK
  fi
  [[ $SHARD =~ ^[0-9]+$ ]] || die "--shard must be a number, got '$SHARD'"
  (( SHARD < EXP_WORKERS )) || die "--shard $SHARD is outside 0..$((EXP_WORKERS - 1)) for $EXPERIMENT ($EXP_WORKERS nodes)"
  [[ -n $NODE_RANK_GIVEN ]] || NODE_RANK=$SHARD
  RUN_NAME=$EXP_RUN_NAME-$NODE_ID
  NODE_EXTRA=()  # a run_name given after `--` names the run; each node's is <run_name>-<node_id>
  for a in "${EXTRA[@]}"; do [[ $a == run_name=* ]] || NODE_EXTRA+=("$a"); done
  TRAIN_ARGS=("experiment=$EXPERIMENT" "$DEVICE" "run_name=$RUN_NAME"
       "distributed.role=$ROLE" "distributed.node_id=$NODE_ID" "distributed.repo_id=$REPO_ID"
       "data.shard=$SHARD" "data.num_shards=$EXP_WORKERS" "${NODE_EXTRA[@]}")
  CMD=("$PY" -m diloco.train "${TRAIN_ARGS[@]}")
  if (( EXP_GPUS_PER_NODE > 1 )); then  # a node of G ranks: DDP inside, its rank 0 talks to the store
    CMD=("$PY" scripts/launch_ranks.py --nnodes 1 --nproc_per_node "$EXP_GPUS_PER_NODE" --standalone
         -m diloco.train "${TRAIN_ARGS[@]}")
  fi
else
  (( NODE_RANK < EXP_NODES )) || die "--node-rank $NODE_RANK is outside 0..$((EXP_NODES - 1)) for $EXPERIMENT"
  if (( EXP_NODES > 1 )); then
    [[ -n $RDZV_ENDPOINT ]] || die "$EXPERIMENT spans $EXP_NODES nodes: --rdzv <node0-host>:<port> is required"
    [[ $RDZV_ENDPOINT =~ ^[^:]+:[0-9]+$ ]] || die "--rdzv must be HOST:PORT, got '$RDZV_ENDPOINT'"
    if [[ $DRY_RUN != 1 && $NODE_RANK != 0 ]]; then
      host=${RDZV_ENDPOINT%:*}; port=${RDZV_ENDPOINT##*:}
      for _ in $(seq 1 30); do  # node 0 may still be starting; give it a minute
        timeout 2 bash -c "exec 3<>/dev/tcp/$host/$port" 2>/dev/null && break
        sleep 2
      done
      timeout 2 bash -c "exec 3<>/dev/tcp/$host/$port" 2>/dev/null \
        || die "rendezvous $RDZV_ENDPOINT is unreachable (is node 0 started? firewall?)"
    fi
  fi
  if [[ -n $RDZV_ENDPOINT ]]; then
    RDZV=(--node_rank "$NODE_RANK" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$EXP_RUN_NAME")
  else
    RDZV=(--standalone)  # one node: torchrun picks a free local port
  fi
  TRAIN_ARGS=("experiment=$EXPERIMENT" "$DEVICE" "${EXTRA[@]}")
  # torchrun, ending in 130 on Ctrl+C/SIGTERM and 2 on a user error, without its tracebacks
  CMD=("$PY" scripts/launch_ranks.py --nnodes "$EXP_NODES" --nproc_per_node "$EXP_GPUS_PER_NODE" "${RDZV[@]}"
       -m diloco.train "${TRAIN_ARGS[@]}")
fi
# the trainer's own validation, before a log folder or a process exists (the dry run included)
notes=$("$PY" scripts/plan.py check "${TRAIN_ARGS[@]}" 2>&1) || die "${notes#error: }"
[[ -z $notes ]] || echo "$notes" >&2

LOG_DIR=$EXP_OUT_DIR/$RUN_NAME
LOG=$LOG_DIR/launch-node$NODE_RANK.log
# the command as shown and logged: a token given as an override never reaches the terminal or the log
SHOWN=$(printf '%q ' "${CMD[@]}" | sed -E 's/(distributed\.token=)[^ ]*/\1<redacted>/g')
if [[ $DRY_RUN == 1 ]]; then
  role=""; [[ $EXP_MODE != dumb_diloco ]] || role=" ($ROLE $NODE_ID, data shard $SHARD of $EXP_WORKERS)"
  echo "# $EXPERIMENT: mode $EXP_MODE, $EXP_NODES node(s) x $EXP_GPUS_PER_NODE, this is node $NODE_RANK$role; log $LOG"
  echo "OMP_NUM_THREADS=$OMP_NUM_THREADS TORCH_NCCL_ASYNC_ERROR_HANDLING=$TORCH_NCCL_ASYNC_ERROR_HANDLING NCCL_DEBUG=$NCCL_DEBUG $SHOWN"
  exit 0
fi
mkdir -p "$LOG_DIR" 2>/dev/null || die "cannot make the run folder $LOG_DIR: choose a writable out_dir"
echo "# $(date -u +%FT%TZ) $SHOWN" >> "$LOG"
[[ -z $notes ]] || echo "$notes" >> "$LOG"  # the notes printed above: the log holds all the terminal shows
# In the background, so that a SIGTERM sent to this script is passed on to the run (a waiting bash
# would die and leave it running); a Ctrl+C reaches it from the terminal, once (`trap - INT`: a
# background command would otherwise start with Ctrl+C ignored). tee -i keeps logging through the
# Ctrl+C, so the log and the terminal get the run's last line ("resume with the same command").
run=""
trap '[[ -z $run ]] || kill -TERM "$run" 2>/dev/null || true' TERM
trap ':' INT
( trap - INT; exec "${CMD[@]}" ) > >(tee -i -a "$LOG") 2>&1 &
run=$!
while :; do
  wait "$run" || true
  kill -0 "$run" 2>/dev/null || break
done
wait "$run" && code=0 || code=$?  # the run's own exit status (130 after a stop), kept by bash
wait || true                      # tee's last lines
exit "$code"

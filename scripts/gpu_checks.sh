#!/usr/bin/env bash
# The GPU checks in one call, for a short lease on a one-GPU machine: the CUDA tests (`make test-gpu`), a
# timing probe of the one-GPU family (`make replicate-gpu`'s five runs cut to 120 steps = 4 rounds each,
# to measure what the whole family costs before spending a lease on it), and the GPU benchmarks
# (`make bench-gpu`). Each step runs under `timeout` inside one overall deadline and logs to $OUT/logs; the
# benchmark records and the probe's summaries and metrics come back as $OUT/results.tgz.
#
#   OUT=/tmp/gpu bash scripts/gpu_checks.sh               # on the GPU machine, from the repository root
#   BUDGET=560 WHEELS=.whl OUT=... bash scripts/gpu_checks.sh
#   SMOKE=1 OUT=/tmp/gpu-smoke bash scripts/gpu_checks.sh  # the same steps on CPU at tiny sizes (~2 min)
#
# BUDGET: seconds for everything (default 560). WHEELS: a folder of wheels to install first with
# `pip --target` (a machine without the project's hydra-core, omegaconf, antlr4, datasets, dill,
# multiprocess and no network); without it the machine's python3, or .venv's with SMOKE=1, must have them.
# A copy of the tree without git names its commit in DILOCO_GIT_COMMIT (every record then carries it).
# The benchmarks rewrite records in results/bench/ (with SMOKE=1 too: run that in a scratch clone).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
end=$((start + ${BUDGET:-560}))
OUT=${OUT:?set OUT to the folder that receives the logs and results.tgz}
logs=$OUT/logs
runs=$(mktemp -d)/gpu-runs
mkdir -p "$logs"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1

if [[ ${SMOKE:-0} == 1 ]]; then
  py=.venv/bin/python
  export DILOCO_GPU_TESTS_ON_CPU=1
  probe=(--cpu-smoke) bench_gpu=(--tiny --allow-cpu) bench_trainer=(--tiny)
else
  py=python3
  if [[ -n ${WHEELS:-} ]]; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-site \
      "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/gpu-site:$PWD/src
  else
    export PYTHONPATH=$PWD/src
  fi
  probe=(--override train.max_steps=120 --override optim.total_steps=120)
  bench_gpu=() bench_trainer=(--models 150m --device cuda)
fi

{
  date -u
  nvidia-smi || true
  nproc
  $py -c "import torch, transformers, datasets, hydra; print(torch.__version__, torch.cuda.is_available(), \
transformers.__version__, datasets.__version__, hydra.__version__)"
} >"$logs/env.txt" 2>&1

# step NAME CAP_SECONDS COMMAND...: runs COMMAND for at most CAP seconds (less if the deadline is nearer)
step() {
  local name=$1 cap=$2 left began rc
  shift 2
  left=$((end - $(date +%s)))
  ((left < cap)) && cap=$left
  if ((cap <= 10)); then
    echo "$name: not run, the budget is spent" >>"$logs/steps.txt"
    return
  fi
  began=$(date +%s)
  timeout -k 5 "$cap" "$@" >"$logs/$name.log" 2>&1
  rc=$?
  echo "$name: exit $rc after $(($(date +%s) - began)) s (cap $cap s)" >>"$logs/steps.txt"
}

step test_gpu 180 $py -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider
step probe 180 $py scripts/replicate.py --family gpu --runs "$runs" "${probe[@]}"
step bench_gpu 140 $py scripts/bench_gpu.py "${bench_gpu[@]}"
step bench_trainer 100 $py scripts/bench_trainer.py "${bench_trainer[@]}"
tar czf "$OUT/results.tgz" results/bench $(ls -d "$runs"/*/summary.json "$runs"/*/metrics.jsonl \
  "$runs"/*/train*.log 2>/dev/null) 2>>"$logs/steps.txt"
cat "$logs/steps.txt"

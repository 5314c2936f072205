"""Run a family of experiments in order: `make replicate-150m`, `replicate-1b`, `ablation-fp16`,
`replicate-tiny`, `replicate-tiny-law`, `replicate-gpu`.

    python scripts/replicate.py --family tiny                     # here, on CPU, every run of the family
    python scripts/replicate.py --family gpu                      # here, every run on this machine's one GPU
    python scripts/replicate.py --family gpu --cpu-smoke          # the same runs, tiny, on CPU (the test suite)
    python scripts/replicate.py --family 150m --dry-run           # plan + 2 real CPU steps of each config
    python scripts/replicate.py --family 150m --hosts-file nodes.txt
    python scripts/replicate.py --family tiny --hosts-file nodes.txt   # a local family on CPU nodes

Paper families run on the GPU nodes listed in a hosts file (one hostname per line, reachable with
password-less ssh, the repository at the same path on each, node 0 = rendezvous; a local family does
too when --hosts-file is given); each run starts `scripts/launch_node.sh` on the nodes it needs and
waits for all of them, then the next run starts. The first node that fails (its launch, or ssh) stops
the run's other nodes (each checkpoints and exits: closing ssh's stdin signals the node) and the
family, in one line naming that node; Ctrl+C does the same for every node.
On SLURM, skip this and `srun scripts/launch_node.sh --experiment <name>` per run instead.
DumbDiLoCo runs need REPO_ID (a Hub repo org/name with HF_TOKEN set on every node, or a shared path).

--dry-run resolves every config, prints the plan (nodes, commands, tokens, bytes per worker) and
takes two real optimizer steps of each config's real model shape on CPU (batch 1, 32 tokens,
the bundled sample in place of C4, read with C4's tokenizer, the paper's, bundled too; DumbDiLoCo as
a lone master polling every second), so a broken config is caught before a GPU hour is spent. Each
leg's own output is printed as it comes, then its time and peak memory; a leg that needs more memory
than is free is validated and skipped, saying so.

Local families run one after another on this machine (`run_local`): the tiny ones on CPU, the one-GPU
family on cuda:0, its W workers sharing the GPU (launch.ranks_per_gpu). --cpu-smoke runs the one-GPU
family's experiments as they are, only with the micro model, 32-token sequences and 20 steps on CPU
(CPU_SMOKE): what the test suite runs to check the pipeline, not the science.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from diloco import memory
from diloco.config import ConfigError, validate
from diloco.experiments.plan import (
    PlanError,
    compose_experiment,
    compose_overrides,
    describe,
    experiments,
    num_parameters,
    topology,
)
from diloco.experiments.records import ROOT

FAMILIES = {  # the order runs are started in
    "150m": [
        "150m/ddp_1x",
        "150m/ddp_8x",
        "150m/diloco_8w_h500",
        "150m/diloco_8w_h50",
        "150m/diloco_8w_h500_fp16",
        "150m/diloco_4w_h500",
        "150m/diloco_4w_h500_fp16",
        "150m/dumb_diloco_8n_h500",
    ],
    "1b": ["1b/ddp", "1b/diloco_4w_h125", "1b/diloco_4w_h500", "1b/dumb_diloco_4n_h125"],
    "7b": ["7b/diloco_4w_fsdp8"],  # past the paper: the size sharded workers exist for (issue 53)
    "fp16": [
        "150m/diloco_4w_h500",
        "150m/diloco_4w_h500_fp16",
        "150m/diloco_8w_h500",
        "150m/diloco_8w_h500_fp16",
    ],
    "tiny": ["tiny/ddp_1x", "tiny/ddp_mx", "tiny/diloco_fp32", "tiny/diloco_fp16", "tiny/dumb_diloco"],
    # issue 33: the family in the scaling-law regime (262k parameters, 52 rounds at H=30, 12.2 tokens per
    # parameter; results/tiny-law-tuning chose every setting), with the compressed formats beside FP32
    "tiny_law": [
        "tiny_law/ddp_1x",
        "tiny_law/ddp_mx",
        "tiny_law/diloco_fp32",
        "tiny_law/diloco_fp16",
        "tiny_law/diloco_int8",
        "tiny_law/diloco_int4",
        "tiny_law/dumb_diloco",
    ],
    # issue 12's heterogeneous bar, with FAMILY_OVERRIDES' slow shard; DumbDiLoCo's nodes share synchronous
    # DiLoCo's tokens (budget: global)
    "tiny-hetero": ["tiny/diloco_fp32", "tiny/dumb_diloco_hetero"],
    # issue 15: the same comparison at 14M on one GPU in about 10 minutes (results/gpu)
    "gpu": ["gpu/ddp_1x", "gpu/ddp_mx", "gpu/diloco_fp32", "gpu/diloco_fp16", "gpu/dumb_diloco"],
    # issue 13: compressed pseudo-gradients and streaming fragments against FP32 (results/tiny-compress)
    "tiny-compress": [
        "tiny/diloco_fp32",
        "tiny/diloco_int8",
        "tiny/diloco_int4",
        "tiny/diloco_stream_p4",
        "tiny/diloco_stream_p4_int4",
        "tiny/dumb_diloco",
        "tiny/dumb_diloco_int4",
    ],
    # issue 32: sparse 2-bit pseudo-gradients and eager updates against FP32 (results/tiny-frontier)
    "tiny-frontier": [
        "tiny/diloco_fp32",
        "tiny/diloco_topk2",
        "tiny/diloco_sparseloco",
        "tiny/diloco_stream_p4",
        "tiny/diloco_stream_p4_eager",
        "tiny/dumb_diloco",
        "tiny/dumb_diloco_topk2",
    ],
    # issue 32 in issue 33's regime (262k parameters, 52 rounds at H=30): results/tiny-law-frontier
    "tiny-law-frontier": [
        "tiny_law/diloco_fp32",
        "tiny_law/diloco_topk2",
        "tiny_law/diloco_sparseloco",
        "tiny_law/diloco_stream_p4",
        "tiny_law/diloco_stream_p4_eager",
        "tiny_law/dumb_diloco",
        "tiny_law/dumb_diloco_topk2",
        "tiny_law/dumb_diloco_sparseloco",
    ],
}

# what a family's every run gets before --override's: tiny-hetero's worker/node 3 is 2x slower, every step
# emulated at 0.25 s (0.5 s on the slow one) as on hardware of its own (configs/experiment/tiny/dumb_diloco_hetero.yaml)
FAMILY_OVERRIDES = {"tiny-hetero": ["train.slowdown=2", "train.slow_shards=[3]", "train.step_seconds=0.25"]}

# the families that run on this machine (run_local), and their device; the rest run on a hosts file's nodes
LOCAL_FAMILIES = {
    "tiny": "cpu",
    "tiny_law": "cpu",
    "tiny-compress": "cpu",
    "tiny-frontier": "cpu",
    "tiny-law-frontier": "cpu",
    "tiny-hetero": "cpu",
    "gpu": "cuda",
}

# --cpu-smoke: every run of a GPU family at a size 2 CPU cores take in seconds. The batches, H and the
# topology (W workers, the DDP ranks, the DumbDiLoCo nodes) stay the experiment's; the micro model reads
# the sample with its own tokenizer (vocab 1024), 60 steps of 32-token sequences (2 rounds at H=30),
# evaluated every 30.
CPU_SMOKE = [
    "model=micro",
    "data.tokenizer=${diloco_asset:sample/tokenizer}",
    "data.seq_len=32",
    "train.max_steps=60",
    "optim.total_steps=60",
    "optim.warmup_steps=5",
    "train.eval_every=30",
    "eval.tokens=2048",
    "wandb.mode=disabled",
]


def family_runs(family: str) -> list[str]:
    known = set(experiments())
    return [e for e in FAMILIES[family] if e in known]


def available_memory() -> int:
    """Bytes of memory available now (Linux /proc/meminfo; unlimited elsewhere)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


# Peak resident memory of one dry-run leg (two fp32 CPU steps, batch 1 x 32 tokens), per parameter of
# the model, plus what torch, the tokenizer and the data take whatever the model: fitted to the peaks
# the legs of `make replicate-150m DRY_RUN=1` measured on CPU (results/bench/dry_run.md: ddp 4.1 GiB,
# diloco 5.5-5.8 GiB, dumb_diloco 13.2 GiB for the 215M-parameter model), rounded up.
# none/ddp: weights, grads, AdamW's two moments (16 bytes) and the step's temporaries; DiLoCo adds the
# float32 global copy and the outer momentum; a DumbDiLoCo master adds its global, momentum, deltas and
# the safetensors files it writes, reads back and hashes.
DRY_RUN_BYTES_PER_PARAM = {"none": 17, "ddp": 17, "diloco": 26, "dumb_diloco": 62}
DRY_RUN_BASE_BYTES = 1 << 30


def dry_run_memory(mode: str, params: int) -> int:
    """The estimated peak resident bytes of a dry-run leg (see DRY_RUN_BYTES_PER_PARAM)."""
    return DRY_RUN_BASE_BYTES + params * DRY_RUN_BYTES_PER_PARAM[mode]


def bundled_tokenizer(cfg) -> str | None:
    """The experiment's tokenizer as its config writes it when it ships with the package (C4's: the
    paper's Mistral-7B-v0.1), so a dry run reads the sample as the real run reads C4; None for a Hub
    name, which would need the network (the dry run then keeps the sample's own)."""
    value = OmegaConf.to_container(cfg.data, resolve=False)["tokenizer"]
    return value if value.startswith("${diloco_asset:") else None


def dry_overrides(name: str, out: Path, mode: str, tokenizer: str | None = None) -> list[str]:
    """Two real optimizer steps of the config's real model shape on CPU, seconds not minutes: batch 1 of
    32 tokens from the bundled sample (read with `tokenizer`, else the sample's), a schedule of two
    steps, and for DumbDiLoCo a lone master that polls every second and does not wait for other nodes
    (drain_timeout=0: one last round)."""
    overrides = [
        f"experiment={name}",
        "device=cpu",
        "precision=fp32",
        "data=sample",
        *([f"data.tokenizer={tokenizer}"] if tokenizer else []),
        "data.seq_len=32",
        "train.batch_size=1",
        "train.micro_batch_size=1",
        "train.max_steps=2",
        "optim.total_steps=2",
        "optim.warmup_steps=1",
        "train.eval_every=0",
        "train.checkpoint_every=0",
        "train.checkpoint_at_end=false",
        "train.progress=false",
        "eval.tokens=32",
        "eval.micro_batch_size=1",
        "optim.foreach=false",
        f"out_dir={out}",
        "run_name=dry",
        "resume=never",
        "wandb.mode=disabled",
    ]
    if mode == "diloco":  # one process stands for a whole worker; take an outer step at step 2
        overrides += ["distributed.ranks_per_worker=1", "distributed.inner_steps=2"]
    if mode == "dumb_diloco":  # a master alone on a throwaway directory repo, one boundary
        overrides += [
            "distributed.role=master",
            "distributed.node_id=dry-run",
            f"distributed.repo_id={out}/repo",
            f"distributed.state_dir={out}/state",
            "distributed.inner_steps=2",
            "distributed.poll_interval=1",
            "distributed.drain_timeout=0",
            "distributed.min_deltas_per_round=0",  # alone: no quorum of nodes to wait for at the start
            "distributed.lease_seconds=0",
            "data.shard=0",
            "data.num_shards=1",
        ]
    return overrides


def dry_steps(name: str, out: Path) -> tuple[float, int] | None:
    """Two real optimizer steps of the config's real model shape on CPU, the child's output printed as
    it comes; returns seconds and the child's peak resident bytes. A leg that needs more memory than
    this machine has free is validated only (None), and says so."""
    cfg = compose_experiment(name)
    mode = cfg.distributed.mode
    overrides = dry_overrides(name, out, mode, bundled_tokenizer(cfg))
    params = num_parameters(cfg.model)
    need, free = dry_run_memory(mode, params), available_memory()
    if need > 0.85 * free:
        validate(compose_overrides(overrides))
        print(
            f"   {name}: config valid; its 2 CPU steps ({mode}) need ~{need / 2**30:.1f} GiB and this machine "
            f"has {free / 2**30:.1f} GiB free: skipped (run the dry run where ~{need / 0.85 / 2**30:.0f} GiB are free)",
            flush=True,
        )
        return None
    print(f"   {name}: 2 CPU steps ({mode}, ~{need / 2**30:.1f} GiB expected) ...", flush=True)
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    t0 = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-m", "diloco.train", *overrides],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    tail: collections.deque[str] = collections.deque(maxlen=5)
    for line in proc.stdout:
        tail.append(line.rstrip())
        print(f"     | {line.rstrip()}", flush=True)
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak memory (ru_maxrss: KiB on Linux)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: two CPU steps failed (exit {proc.returncode}):\n" + "\n".join(tail))
    return time.time() - t0, usage.ru_maxrss * 1024


# On a node: a watcher on the ssh connection's stdin beside the launch (exec'd, so $$ is the launch's own
# pid). When this machine closes that stdin (another node failed, Ctrl+C here) or the connection drops, the
# launch gets SIGTERM and stops as on a Ctrl+C of its own (the ranks' last step, a checkpoint, exit 130);
# without it a node whose peer died would wait out the rendezvous or collective timeout. fd 3 keeps the
# connection's stdin for the watcher: a background job's own stdin is /dev/null.
REMOTE = "cd {root} && exec 3<&0 </dev/null && {{ {{ cat <&3; kill -TERM $$; }} >/dev/null 2>&1 & }} && exec {launch} 3<&-"
SSH = [
    "ssh",
    "-o",
    "BatchMode=yes",
]  # password-less or nothing: a password prompt per node would hang the run


def read_hosts(path: Path) -> list[str]:
    """The hostnames of a hosts file, one per line, node 0 first (blank lines and # comments skipped)."""
    if not path.exists():
        raise PlanError(f"no hosts file {path}: list the GPU nodes, one per line (see README)")
    hosts = [h for line in path.read_text().splitlines() if (h := line.split("#", 1)[0].strip())]
    if twice := sorted({h for h in hosts if hosts.count(h) > 1}):
        raise PlanError(f"the hosts file {path} lists {', '.join(twice)} more than once: one line per node")
    return hosts


@dataclass(frozen=True)
class NodeLaunch:
    host: str
    command: str  # the shell command line ssh runs there
    log: str  # where its launch writes its log, on that host (relative: to the repository)


def ssh_commands(
    name: str, hosts: list[str], port: int, overrides: list[str] = (), cpu: bool = False
) -> list[NodeLaunch]:
    """Each node's `scripts/launch_node.sh` for one run of a family; `overrides` follow `--`."""
    cfg = compose_experiment(name, list(overrides))
    topo = topology(cfg)
    if len(hosts) < topo["nodes"]:
        raise PlanError(f"{name} needs {topo['nodes']} nodes; the hosts file lists {len(hosts)}")
    dumb = topo["mode"] == "dumb_diloco"
    repo = os.environ.get("REPO_ID") or ""
    if dumb and not repo:
        raise PlanError(f"{name} is a DumbDiLoCo run: set REPO_ID (org/name on the Hub, or a shared path)")
    launches = []
    for rank in range(topo["nodes"]):
        args = ["scripts/launch_node.sh", "--experiment", name, *(["--cpu"] if cpu else [])]
        run_dir = f"{cfg.out_dir}/{cfg.run_name}"
        if dumb:
            role = "master" if rank == 0 else "worker"
            args += ["--role", role, "--node-id", f"node-{rank}", "--repo-id", repo, "--shard", str(rank)]
            run_dir += f"-node-{rank}"
        elif topo["nodes"] > 1:  # one node: torchrun --standalone picks a free port of its own
            args += ["--node-rank", str(rank), "--rdzv", f"{hosts[0]}:{port}"]
        if overrides:
            args += ["--", *overrides]
        command = REMOTE.format(root=shlex.quote(str(ROOT)), launch=shlex.join(args))
        launches.append(NodeLaunch(hosts[rank], command, f"{run_dir}/launch-node{rank}.log"))
    return launches


def _failure(node: NodeLaunch, code: int) -> str:
    """How a node's launch ended, for the one line that names it."""
    if code == 255:
        return f"{node.host}: ssh could not run it there (exit 255: unreachable, refused, or the connection dropped)"
    how = f"exit {code}" if code >= 0 else f"killed by signal {-code}"
    return f"{node.host} ({how}; its log there: {node.log})"


def run_cluster(name: str, launches: list[NodeLaunch]) -> None:
    """Start every node's launch over ssh and wait for all. The first node that fails stops the others
    (their launches checkpoint and exit) and the run fails naming it; so does Ctrl+C here, after the nodes
    have checkpointed and exited. The waiting is on this thread, in steps of POLL_S: a SIGINT that the
    kernel hands to another thread of this process would not wake one blocked without a timeout."""
    procs = [(n, subprocess.Popen([*SSH, n.host, n.command], stdin=subprocess.PIPE)) for n in launches]

    def stop_all() -> None:
        for _, p in procs:
            if not p.stdin.closed:
                p.stdin.close()  # the node's watcher sees the end of its stdin: SIGTERM to its launch

    first: tuple[NodeLaunch, int] | None = None  # the first node that failed, and its exit code
    try:
        running = list(procs)
        while running:
            for node, p in list(running):
                if (code := _wait_step(p)) is None:
                    continue
                running.remove((node, p))
                if code != 0 and first is None:  # what the others do after the stop is its doing
                    first = (node, code)
                    stop_all()
    except KeyboardInterrupt:
        stop_all()
        for _, p in procs:
            p.wait()  # each node checkpoints, then exits
        raise
    finally:
        stop_all()  # a finished node's watcher ends with its stdin
    if first is not None:
        node, code = first
        others = ", ".join(n.host for n in launches if n is not node)
        raise RuntimeError(
            f"{name} failed on {_failure(node, code)}"
            + (f"; the other nodes were stopped ({others})" if others else "")
            + "; the family's next runs were not started"
        )


POLL_S = 0.2


def _wait_step(p: subprocess.Popen) -> int | None:
    try:
        return p.wait(timeout=POLL_S)
    except subprocess.TimeoutExpired:
        return None


def run_local(name: str, runs: Path, overrides: list[str] = (), device: str = "cpu") -> None:
    """A local family's run on this machine: on CPU (the tiny families, --cpu-smoke) or on its GPU."""
    cfg = compose_experiment(name, list(overrides))
    common = [f"out_dir={runs}", "train.progress=false", *overrides]
    dumb = cfg.distributed.mode == "dumb_diloco"  # its master's summary holds the final global's evaluation
    summary = runs / (f"{cfg.run_name}-node-0" if dumb else cfg.run_name) / "summary.json"
    done = json.loads(summary.read_text()) if summary.exists() else {}
    if done.get("status") == "completed" and (dumb or done.get("step") == cfg.train.max_steps):
        print(f"   {name}: already complete in {summary.parent} (delete it to run again)", flush=True)
        return
    cpu = ["--cpu"] if device == "cpu" else []
    if not dumb:
        subprocess.run(
            ["scripts/launch_node.sh", "--experiment", name, *cpu, "--", *common], cwd=ROOT, check=True
        )
        return
    nodes = topology(cfg)["nodes"]
    repo = runs / f"{cfg.run_name}-repo"
    # an asynchronous run cannot resume as a whole: start it fresh (repository, master state, node runs)
    for stale in [
        repo,
        runs / f"{cfg.run_name}-state",
        *(runs / f"{cfg.run_name}-node-{i}{part}" for i in range(nodes) for part in ("", "-state")),
    ]:
        shutil.rmtree(stale, ignore_errors=True)
    procs = []
    for rank in range(nodes):
        args = [
            "scripts/launch_node.sh",
            "--experiment",
            name,
            *cpu,
            "--role",
            "master" if rank == 0 else "worker",
            "--node-id",
            f"node-{rank}",
            "--repo-id",
            str(repo.resolve()),
            "--shard",
            str(rank),
            "--",
            *common,
            # the master's evaluations are the run's, as synchronous DiLoCo's rank 0's are; a worker's would
            # be of its own weights, and on shared cores they slow every node (workers: the final one only)
            *(["train.eval_every=0"] if rank > 0 else []),
        ]
        procs.append(subprocess.Popen(args, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}))
        if rank == 0:
            time.sleep(2)  # the master publishes the initial global model first
    codes = [p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"{name}: node exit codes {codes}")


def no_cuda() -> str | None:
    """Why this machine cannot run on a GPU, or None when it can."""
    import torch

    if not torch.cuda.is_available():
        return "this machine has none (torch.cuda.is_available() is False)"
    return None


def dry_run(names: list[str], overrides: list[str]) -> int:
    """The plan's last check: a layout that cannot fit one GPU is one line (exit 2), else 2 real CPU steps
    of each run."""
    unfit = {n: memory.refusal(compose_experiment(n, overrides)) for n in names}
    for name, why in unfit.items():
        if why is not None:
            print(f"error: {name}: does not fit one GPU: {why}", file=sys.stderr)
    if any(unfit.values()):
        return 2
    with tempfile.TemporaryDirectory(prefix="diloco-dry-") as tmp:
        for name in names:
            measured = dry_steps(name, Path(tmp) / name.replace("/", "_"))
            if measured is None:
                continue
            secs, peak = measured
            print(
                f"   {name}: 2 real optimizer steps on CPU OK ({secs:.0f} s, peak {peak / 2**30:.2f} GiB)",
                flush=True,
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", required=True, choices=sorted(FAMILIES))
    p.add_argument("--dry-run", action="store_true")
    p.add_argument(
        "--hosts-file",
        type=Path,
        help="run on these nodes over ssh, a local family too (default for the paper families: $NODES_FILE, "
        "else configs/local/nodes.txt)",
    )
    p.add_argument("--port", type=int, default=int(os.environ.get("RDZV_PORT", 29500)))
    p.add_argument("--runs", type=Path, default=Path("runs"))
    p.add_argument("--only", nargs="*", help="a subset of the family's experiments")
    p.add_argument(
        "--override",
        action="append",
        default=[],
        help="a hydra override for every run (on nodes: after `--`)",
    )
    p.add_argument(
        "--cpu-smoke", action="store_true", help="a GPU family's runs, tiny, on CPU (the test suite's check)"
    )
    args = p.parse_args(argv)
    device = LOCAL_FAMILIES.get(args.family)
    args.override = [*FAMILY_OVERRIDES.get(args.family, []), *args.override]
    if args.cpu_smoke:
        if device != "cuda":
            p.error(
                f"--cpu-smoke is for a GPU family ({', '.join(f for f, d in LOCAL_FAMILIES.items() if d == 'cuda')})"
            )
        device, args.override = "cpu", [*CPU_SMOKE, *args.override]
        os.environ["OMP_NUM_THREADS"] = "1"  # up to 4 ranks on a few cores: one thread each, not 2 each
    if device == "cuda" and not args.dry_run and args.hosts_file is None and (why := no_cuda()):
        print(
            f"error: the {args.family} family needs a CUDA GPU and {why} (`make replicate-gpu SMOKE=1`, or --cpu-smoke, runs it tiny on CPU)",
            file=sys.stderr,
        )
        return 1
    names = [n for n in family_runs(args.family) if not args.only or n in args.only]
    try:
        for name in names:
            print(describe(name), flush=True)
        if args.dry_run:
            return dry_run(names, args.override)
        if device is not None and args.hosts_file is None:  # a family that runs on this machine
            for name in names:
                run_local(name, args.runs, args.override, device)
            return 0
        hosts = read_hosts(args.hosts_file or Path(os.environ.get("NODES_FILE") or "configs/local/nodes.txt"))
        if shutil.which(SSH[0]) is None:
            raise PlanError(
                "no ssh client on PATH: the nodes are started over ssh (on SLURM use srun, see README)"
            )
        cluster = [
            f"out_dir={args.runs}",
            *args.override,
        ]  # out_dir: on each node, relative to the repository
        launches = {
            name: ssh_commands(name, hosts, args.port, cluster, cpu=device == "cpu") for name in names
        }
        for name in names:  # every run's nodes were checked before the first starts
            run_cluster(name, launches[name])
    except (PlanError, ConfigError, RuntimeError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # every node was told to stop: run the same command again to resume
        print("error: stopped (Ctrl+C); the runs started were told to stop and checkpoint", file=sys.stderr)
        return 130
    return 0


def take_ctrl_c() -> None:
    """For the command's entry point: Ctrl+C stops the nodes (run_cluster) also when the runner was started
    from a script's background job (`make replicate-... &`), which inherits SIGINT ignored and would never
    see it; the trainer's StopFlag installs its own handler likewise."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


if __name__ == "__main__":
    take_ctrl_c()
    sys.exit(main())

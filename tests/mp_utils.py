"""Multi-process tests on one CPU machine: N gloo ranks on 127.0.0.1, one thread each.

`run_ranks("module:function", n, **kwargs)` starts n fresh Python processes with the environment
torchrun would give them (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT), calls
`function(**kwargs)` in each (module imported from its folder under tests/), and returns what each returned.
`run_trainer(n, overrides)` starts n ranks of `python -m diloco.train` the same way. Both enforce a
timeout and kill their own stragglers (by pid) whatever happens.

The rendezvous cannot race for a port: this process hosts the job's TCPStore on a port the kernel
picked (bound to port 0 and kept bound until the job is over), and the ranks join it as clients, as
torchrun's workers join their agent's store: with TORCHELASTIC_USE_AGENT_STORE=True,
`init_process_group` (env://, as the trainer calls it) connects to MASTER_PORT instead of serving on
it. (Asking the kernel for a free port, closing it and handing the number to rank 0 to bind again
loses that port to any other process that binds in between, which happens on a loaded machine.)
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
QUIET_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "WANDB_MODE": "disabled",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


# `diloco.train` under torchrun with 2 ranks on this node. --standalone: torchrun's agent binds its
# rendezvous store to port 0 and keeps it, and the ranks join it as clients, so no port is picked,
# released and bound again (a race with other processes under load).
TORCHRUN_TRAIN_2 = [
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--nproc_per_node",
    "2",
    "-m",
    "diloco.train",
]


def rank_env(rank: int, world: int, per_node: int, port: int) -> dict[str, str]:
    return {
        **os.environ,
        **QUIET_ENV,
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank % per_node),
        "LOCAL_WORLD_SIZE": str(per_node),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # join the store at MASTER_PORT (see the module docstring)
    }


class Job(list):
    """The ranks' Popen objects (a list), and the TCPStore they rendezvous on, alive as long as the job."""

    store: object = None


@dataclass
class RankResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def start(cmds: list[list[str]], per_node: int | None = None, env: dict | None = None) -> Job:
    """Start one process per command as ranks 0..n-1 of one job; returns the Popen objects (a Job)."""
    from torch.distributed import TCPStore

    n = len(cmds)
    procs = Job()
    # port 0: the kernel picks a free port and the store keeps it bound; the ranks only connect to it
    procs.store = TCPStore("127.0.0.1", 0, world_size=n, is_master=True, wait_for_workers=False)
    for rank, cmd in enumerate(cmds):
        e = {**rank_env(rank, n, per_node or n, procs.store.port), **(env or {})}
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    return procs


def wait(procs, timeout: float) -> list[RankResult]:
    """Wait for every process; past the deadline, kill the ones still running and fail."""
    t0 = time.monotonic()
    results = []
    try:
        for rank, p in enumerate(procs):
            left = max(timeout - (time.monotonic() - t0), 0.1)
            try:
                out, err = p.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"rank {rank} still running after {timeout:.0f} s") from None
            results.append(RankResult(rank, p.returncode, out, err, time.monotonic() - t0))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return results


def check(results: list[RankResult], what: str) -> list[RankResult]:
    """Fail with the end of the stderr of every rank that did not exit 0."""
    failed = [r for r in results if r.returncode != 0]
    report = "\n".join(
        f"--- rank {r.rank} of {what} exited {r.returncode}:\n{r.stderr[-2500:]}" for r in failed
    )
    assert not failed, report
    return results


def run_trainer(nprocs: int, overrides: list[str], per_node: int | None = None, timeout: float = 300):
    """n ranks of the real trainer; asserts that every rank exited 0 and returns their results."""
    procs = start([[sys.executable, "-m", "diloco.train", *overrides]] * nprocs, per_node)
    return check(wait(procs, timeout), "diloco.train")


def run_ranks(target: str, nprocs: int, timeout: float = 300, per_node: int | None = None, **kwargs):
    """Call <module>.<function>(**kwargs) in n gloo ranks, the module a test file anywhere under tests/ (by
    its unique basename); the list of return values, by rank."""
    with tempfile.TemporaryDirectory() as tmp:
        args = Path(tmp) / "args.pkl"
        args.write_bytes(pickle.dumps(kwargs))
        cmds = [
            [sys.executable, str(Path(__file__)), target, str(args), str(Path(tmp) / f"out{r}.pkl")]
            for r in range(nprocs)
        ]
        check(wait(start(cmds, per_node), timeout), target)
        return [pickle.loads((Path(tmp) / f"out{r}.pkl").read_bytes()) for r in range(nprocs)]


def _child(target: str, args_path: str, out_path: str) -> None:
    import pkgutil

    import torch

    torch.set_num_threads(1)
    module, function = target.split(":")
    sys.path[:0] = sorted({str(f.parent) for f in TESTS.rglob(f"{module}.py")})  # tests/<folder>/<module>.py
    fn = pkgutil.resolve_name(target)
    result = fn(**pickle.loads(Path(args_path).read_bytes()))
    Path(out_path).write_bytes(pickle.dumps(result))
    import torch.distributed as dist

    if dist.is_initialized():  # barrier first: a rank that tears down early can abort a peer mid-send
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    _child(*sys.argv[1:4])


def wait_for_nodes(procs: list, out_dir, timeout: float) -> float:
    """Wait for each (node_id, Popen, open log file) in order, within `timeout` seconds in all; each must
    exit 0 (else the assertion shows its <out_dir>/<node_id>.out tail). Kills what is left; returns the
    seconds taken."""
    t0 = time.monotonic()
    try:
        for node_id, p, log in procs:
            p.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
            log.close()
            out = (out_dir / f"{node_id}.out").read_text()
            assert p.returncode == 0, f"{node_id} exited {p.returncode}:\n{out[-4000:]}"
    finally:
        for _, p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return time.monotonic() - t0

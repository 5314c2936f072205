"""distributed=ddp through the real launcher: `python -m torch.distributed.run` (torchrun) with 2 gloo
ranks splitting one global batch; bytes all-reduced per step are measured and logged.
(DDP == one process with the same global batch is checked on a tiny model in test_diloco_mp.py.)"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from mp_utils import QUIET_ENV, ROOT, TORCHRUN_TRAIN_2
from trainer_utils import SMALL, read_metrics

from diloco import checkpoint

pytestmark = pytest.mark.slow


def test_ddp_under_torchrun_counts_bytes_and_keeps_ranks_identical(tmp_path):
    import os

    steps = 3
    cmd = [
        *TORCHRUN_TRAIN_2,
        *SMALL,
        "distributed=ddp",
        f"train.max_steps={steps}",
        "train.micro_batch_size=1",
        f"out_dir={tmp_path}",
        "run_name=ddp",
    ]
    done = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, **QUIET_ENV}, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]

    run = tmp_path / "ddp"
    summary = json.loads((run / "summary.json").read_text())
    numel = summary["parameters"]["total"]
    assert summary["world_size"] == 2 and summary["num_workers"] == 1
    assert summary["comm/total_bytes"] == steps * numel * 4  # one float32 gradient all-reduce per step
    logged = [r for r in read_metrics(run) if "comm/bytes_per_step" in r]
    assert [r["comm/bytes_per_step"] for r in logged] == [numel * 4] * steps
    assert logged[-1]["total_samples"] == steps * 4  # the global batch (train.batch_size=4), not per rank

    states = [torch.load(checkpoint.latest(run) / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    w0, w1 = states[0]["model"], states[1]["model"]
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


# ------------------------------------------------------------------------------------------ stopping together
def stop_rank(requests: dict[int, int], steps: int) -> int:
    """One rank: its stop request arrives at step requests[rank] (if any); returns the step it stops at."""
    import torch.distributed as dist

    from diloco.distributed import DistContext, StopAgreement

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ctx = DistContext(rank=rank, world_size=dist.get_world_size())
    agree, step = StopAgreement(ctx), 0
    while step < steps and not agree(rank in requests and step >= requests[rank]):
        step += 1
        if step % 2:  # an uneven pace: the other rank's request is seen through the all-reduce only
            dist.all_reduce(torch.zeros(1))
    agree.finish()
    dist.destroy_process_group()
    return step


def test_every_rank_stops_after_the_same_step():
    """Rank 1 alone sees the Ctrl+C (at step 3): both ranks stop after step 4, one step later."""
    from mp_utils import run_ranks

    assert run_ranks("test_ddp:stop_rank", 2, requests={1: 3}, steps=10) == [4, 4]
    assert run_ranks("test_ddp:stop_rank", 2, requests={}, steps=5) == [5, 5]

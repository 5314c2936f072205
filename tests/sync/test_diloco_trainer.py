"""The real entry point with 2 gloo ranks (2 DiLoCo workers of 1 rank): FP16 pseudo-gradients with
measured bytes and cast error, bit-exact resume mid-round on every rank, and a killed rank."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from mp_utils import run_trainer, start, wait
from trainer_utils import SMALL, read_metrics

from diloco import checkpoint

pytestmark = pytest.mark.slow

H = 2
DILOCO = [
    *SMALL,
    "distributed=diloco",
    f"distributed.inner_steps={H}",
    "distributed.pseudo_grad_dtype=float16",
]


def launch(tmp_path: Path, name: str, *overrides: str):
    return run_trainer(2, [*DILOCO, f"out_dir={tmp_path}", f"run_name={name}", *overrides], per_node=1)


def rank_state(run_dir: Path, rank: int) -> dict:
    return torch.load(checkpoint.latest(run_dir) / f"rank{rank}.pt", map_location="cpu", weights_only=True)


def test_two_worker_run_measures_bytes_and_resumes_bit_for_bit(tmp_path):
    launch(tmp_path, "full", "train.max_steps=6")
    launch(tmp_path, "part", "train.max_steps=3")  # stops mid-round (H=2), checkpointing every rank
    launch(tmp_path, "part", "train.max_steps=6")  # resumes: global weights, momentum, AdamW, data

    for rank in (0, 1):
        full, part = rank_state(tmp_path / "full", rank), rank_state(tmp_path / "part", rank)
        assert all(torch.equal(full["model"][k], part["model"][k]) for k in full["model"])
        sf, sp = full["strategy"], part["strategy"]
        assert all(torch.equal(a, b) for a, b in zip(sf["global_params"], sp["global_params"]))
        mf, mp = sf["outer_optimizer"]["state"], sp["outer_optimizer"]["state"]
        assert all(torch.equal(mf[k]["momentum_buffer"], mp[k]["momentum_buffer"]) for k in mf)
        assert full["data"] == part["data"]  # each rank read its own shard to the same place
    # both workers end on the same global weights (6 is a multiple of H)
    r0, r1 = rank_state(tmp_path / "full", 0), rank_state(tmp_path / "full", 1)
    assert all(torch.equal(r0["model"][k], r1["model"][k]) for k in r0["model"])

    numel = json.loads((tmp_path / "full" / "summary.json").read_text())["parameters"]["total"]
    rounds = [r for r in read_metrics(tmp_path / "full") if "outer/round" in r]
    assert [r["step"] for r in rounds] == [2, 4, 6]
    for r in rounds:
        assert r["num_peers"] == 2 and r["outer_lr"] == 0.7
        assert r["comm/bytes_float16"] == numel * 2
        assert abs(r["comm/bytes"] - numel * 2) < 0.01 * numel * 2
        assert 0 < r["comm/cast_rel_error"] < 2**-10 and r["comm/cast_overflow_frac"] == 0
        assert -1 <= r["outer/cosine_similarity"] <= 1 and r["comm/seconds"] >= 0
        assert 0 < r["comm/mean_rel_error"] < 2**-10  # the average of two float16 casts, sampled
        assert 0 < r["outer/compute_utilization"] <= 1
    summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert summary["comm/total_bytes"] == sum(r["comm/bytes"] for r in rounds)
    assert summary["num_workers"] == 2 and summary["outer/rounds"] == 3
    resumed = json.loads((tmp_path / "part" / "summary.json").read_text())
    assert resumed["comm/total_bytes"] == summary["comm/total_bytes"]


@pytest.mark.alone  # a bound in seconds: run with the machine to itself (issue 54)
def test_killed_rank_makes_the_other_fail_with_a_readable_error(tmp_path):
    # A dead peer's closed connection fails rank 0's next collective at once; only a rank that waited
    # for the collective timeout instead would take this long, however loaded the machine.
    timeout = 60
    cmd = [
        sys.executable,
        "-m",
        "diloco.train",
        *DILOCO,
        f"out_dir={tmp_path}",
        "run_name=kill",
        "train.max_steps=10000",
        "optim.total_steps=10000",
        f"distributed.timeout_seconds={timeout}",
    ]
    procs = start([cmd, cmd], per_node=1)
    metrics = tmp_path / "kill" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    try:
        while not (metrics.exists() and '"outer/round": 2' in metrics.read_text()):
            assert time.monotonic() < deadline, "the run never reached its second outer step"
            assert procs[0].poll() is None, procs[0].communicate()[1][-2000:]
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        procs[0].wait(timeout=timeout + 10)
        elapsed = time.monotonic() - killed
    finally:
        results = wait(procs, timeout=5)
    assert elapsed < timeout, f"rank 0 took {elapsed:.1f} s to notice"
    err = results[0].stderr
    assert results[0].returncode == 2, err[-2000:]
    assert "error: " in err and "peer rank died, hung or lost its connection" in err
    assert "Traceback" not in err

"""scripts/async_acceptance.py's heterogeneous pair, on made-up logs: the time DumbDiLoCo's master takes to
reach synchronous DiLoCo's final perplexity, from the first node's start, against synchronous DiLoCo's
wall time; a run made from a dirty tree is refused; emulated step overruns are reported."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from diloco.experiments.studies import async_acceptance

T0 = datetime(2026, 12, 2, 10, 0, 0)


def run(path: Path, start: float, evals: list[tuple[float, int, float]], commit="abc", emulated=None):
    """A run directory: train.log (its first line at `start`, evaluations at (t, step, ppl); seconds after
    one common instant) and summary.json."""
    path.mkdir(parents=True)
    stamp = lambda s: (T0 + timedelta(seconds=s)).strftime("%Y-%m-%d %H:%M:%S,%f")[:23]  # noqa: E731
    lines = [f"{stamp(start)} INFO [rank 0] model micro: 0.7M parameters"]
    lines += [f"{stamp(t)} INFO step {step}: eval loss 4.0, perplexity {ppl}" for t, step, ppl in evals]
    (path / "train.log").write_text("\n".join(lines) + "\n")
    summary = {"git_commit": commit, "status": "completed"} | (
        {"emulated_step": emulated} if emulated else {}
    )
    (path / "summary.json").write_text(json.dumps(summary))


def pair(tmp, sync_commit="abc"):
    run(
        tmp / "sync",
        0,
        [(100, 200, 80.0), (200, 400, 68.0)],
        sync_commit,
        {"seconds": 0.5, "steps": 400, "steps_over": 4},
    )
    # the master starts 10 s after the first worker: its times count from the worker's start
    run(
        tmp / "dumb-node-0",
        10,
        [(60, 200, 75.0), (110, 300, 68.5), (130, 350, 67.9), (150, 400, 67.0)],
        emulated={"seconds": 0.25, "steps": 400, "steps_over": 0},
    )
    run(tmp / "dumb-node-1", 0, [], emulated={"seconds": 0.5, "steps": 200, "steps_over": 0})
    (tmp / "dumb-node-0-state").mkdir()  # the master's state directory is not a run
    return f"{tmp / 'sync'},{tmp / 'dumb'}"


def test_the_ratio_is_the_masters_first_evaluation_at_or_below_the_target(tmp_path):
    h = async_acceptance.heterogeneous(pair(tmp_path))
    assert h["target_ppl"] == 68.0 and h["sync_seconds"] == 200.0
    assert h["dumb_reached"] == (130.0, 350, 67.9)  # counted from the worker's start, not the master's
    assert h["ratio"] == pytest.approx(0.65) and h["verdict"] == "PASS"
    assert h["commits"] == ["abc"] and set(h["emulated_step"]) == {"sync", "dumb-node-0", "dumb-node-1"}


def test_a_run_from_a_dirty_tree_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="dirty tree"):
        async_acceptance.heterogeneous(pair(tmp_path, sync_commit="abc-dirty"))


def test_the_seed_mean_is_the_mean_curve_against_the_mean_target(tmp_path):
    first = async_acceptance.heterogeneous(pair(tmp_path / "a"))
    second = dict(
        first, target_ppl=67.0, dumb_curve=[(t + 20, s, p + 1.0) for t, s, p in first["dumb_curve"]]
    )
    mean = async_acceptance.seed_mean([first, second])
    # target (68 + 67) / 2 = 67.5; mean curve 75.5, 69.0, 68.4, 67.5 at 70, 120, 140, 160 s
    assert mean["target_ppl"] == 67.5 and mean["dumb_reached"] == (160.0, 400, 67.5)
    assert mean["ratio"] == pytest.approx(0.8)
    assert async_acceptance.seed_mean([first]) is None

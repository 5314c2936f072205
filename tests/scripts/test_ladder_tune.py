"""The ladder's and the tuning sweep's records from run summaries: the gap per seed, its mean and spread,
the ranking by the mean over seeds, and the refusal of runs from a dirty tree."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import tune_tiny  # noqa: E402

from diloco.experiments import sweep  # noqa: E402
from diloco.experiments.plan import compose_experiment  # noqa: E402
from diloco.experiments.studies import ladder  # noqa: E402


def summary(path: Path, ppl: float, commit: str = "abc123", step: int = 400) -> None:
    path.mkdir(parents=True)
    s = {"step": step, "status": "completed", "final_eval_perplexity": ppl, "tokens_seen": 1_638_400}
    (path / "summary.json").write_text(json.dumps({**s, "wall_seconds": 90.0, "git_commit": commit}))


def ladder_runs(runs: Path, ppl: dict, commit: str = "abc123") -> None:
    for (method, seed), p in ppl.items():
        name = compose_experiment(ladder.METHODS[method], ladder.overrides("micro", seed)).run_name
        summary(ladder.run_dir(runs, "micro", seed) / name, p, commit)


def test_a_ladder_rung_is_the_relative_gap_per_seed_with_mean_and_spread(tmp_path):
    ladder_runs(tmp_path, {("ddp", 1): 50.0, ("diloco", 1): 60.0, ("ddp", 2): 40.0, ("diloco", 2): 44.0})
    r = ladder.rung(tmp_path, "micro", [1, 2])
    assert r["parameters"] == 688_768
    assert r["gap_per_seed"] == pytest.approx([0.2, 0.1])
    assert (r["gap_mean"], r["gap_spread"]) == pytest.approx((0.15, 0.1))
    assert r["gap_of_means"] == pytest.approx(104 / 90 - 1)
    assert (
        "| 688,768 (micro) | 50.00, 40.00 | 60.00, 44.00 | +20.0%, +10.0% | +15.0% ± 10.0% |"
        in ladder.table([r], [1, 2])
    )


def test_a_ladder_run_from_a_dirty_tree_is_refused(tmp_path):
    ladder_runs(tmp_path, {("ddp", 1): 50.0, ("diloco", 1): 60.0}, commit="abc123-dirty")
    with pytest.raises(SystemExit, match="dirty"):
        ladder.rung(tmp_path, "micro", [1])


def test_the_tuning_record_ranks_each_methods_settings_by_their_mean_over_seeds(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "unique_tokens_of", lambda size: 7_675_719)
    for experiment, settings in tune_tiny.GRID.items():
        for i, (setting, _) in enumerate(settings):
            for seed, offset in ((1337, 0.0), (1, 2.0)):
                summary(
                    tmp_path / "runs" / tune_tiny.SWEEP.run_name(experiment, setting, seed), 50.0 + i + offset
                )
    assert (
        tune_tiny.main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--report-only"])
        == 0
    )
    record = json.loads((tmp_path / "out" / "summary.json").read_text())
    first = record["rows"][0]  # diloco's first setting: plain averaging at H=10
    assert (first["setting"], first["per_seed"], first["mean"], first["spread"]) == (
        "h10-lr1.0-m0.0",
        [50.0, 52.0],
        51.0,
        2.0,
    )
    table = (tmp_path / "out" / "table.md").read_text()
    assert "| 1 | h10-lr1.0-m0.0 | 50.00 | 52.00 | 51.00 | 2.00 |" in table
    assert "| 3 | lr0.004 | 52.00 | 54.00 | 53.00 | 2.00 |" in table
    assert "tiny/ddp_mx 1,638,400 (0.21 epochs)" in table

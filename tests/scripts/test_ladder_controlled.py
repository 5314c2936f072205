"""Issue 42's controlled ladder, from its grid and from run summaries: every rung reads the same tokens
per non-embedding parameter and the same global batch in tokens in both methods, the lr grid grows past
a winning edge on the tuning seeds' mean, the finals are fresh seeds on the report half, the slope is
fitted to rung means, and a committed record's runs come back for the next batch."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from diloco.experiments.plan import compose_experiment, topology
from diloco.experiments.studies import ladder_controlled as lc
from diloco.scaling_law import LossGapLaw

STUDY = lc.Study.load()


def tokens_per_step(rung: str, method: str) -> int:
    cfg = compose_experiment(lc.METHODS[method], STUDY.overrides(rung, method, 2e-3, 2, "report"))
    return cfg.train.batch_size * topology(cfg)["workers"] * cfg.data.seq_len


def test_every_rung_reads_the_same_tokens_per_parameter_and_global_batch_in_one_epoch_at_most():
    batches = {tokens_per_step(r, m) for r in STUDY.rungs for m in lc.METHODS}
    assert batches == {STUDY.global_batch * 128}
    sizes = [lc.non_embedding(r) for r in STUDY.rungs]
    assert sizes == sorted(sizes) and sizes[-1] / sizes[0] >= 10  # the 10x, non-embedding
    for rung in STUDY.rungs:
        regime = lc.regime(STUDY, rung)
        assert regime["tokens_per_parameter"]["non_embedding"] == pytest.approx(20, rel=0.03)
        assert regime["epochs"] <= 1
        assert regime["steps"] % STUDY.inner_steps == 0


@pytest.mark.parametrize("method", list(lc.METHODS))
def test_a_rungs_runs_differ_only_in_their_lr_seed_and_half(method):
    """The sweep's and the finals' configs are the same run apart from lr, seed, evaluation half and name."""
    a = compose_experiment(lc.METHODS[method], STUDY.overrides("2m", method, 2e-3, 1337, "tune"))
    b = compose_experiment(lc.METHODS[method], STUDY.overrides("2m", method, 8e-3, 3, "report"))
    assert (a.optim.lr, a.seed, a.data.eval_subset) == (2e-3, 1337, "tune")
    assert (b.optim.lr, b.seed, b.data.eval_subset) == (8e-3, 3, "report")
    for cfg in (a, b):
        cfg.optim.lr, cfg.seed, cfg.data.eval_subset, cfg.run_name = 0, 0, "", ""
    assert a == b
    assert not set(STUDY.tune_seeds) & set(STUDY.report_seeds)


def summary(runs: Path, key: tuple, loss: float) -> None:
    s = {"step": STUDY.steps(key[0]), "status": "completed", "final_eval_loss": loss}
    s |= {"final_eval_perplexity": math.exp(loss), "tokens_seen": 1, "wall_seconds": 1.0}
    s |= {"git_commit": "abc123", "parameters": lc.parameters(key[0])}
    (runs / STUDY.run_name(*key)).mkdir(parents=True)
    (runs / STUDY.run_name(*key) / "summary.json").write_text(json.dumps(s))


def sweep_of(runs: Path, rung: str, method: str, losses: dict[float, tuple[float, float]]) -> None:
    for lr, per_seed in losses.items():
        for seed, loss in zip(STUDY.tune_seeds, per_seed):
            summary(runs, (rung, method, lr, seed, "tune"), loss)


def test_the_grid_grows_past_an_edge_that_wins_on_the_mean_and_stops_inside(tmp_path):
    sweep_of(tmp_path, "2m", "ddp", {2e-3: (3.7, 3.7), 4e-3: (3.6, 3.6), 8e-3: (3.4, 3.9)})
    assert lc.lr_sweep(STUDY, tmp_path, "2m", "ddp", dry=True)["best"] == 4e-3  # the mean, not seed 1337
    sweep_of(tmp_path, "2m", "diloco", {2e-3: (3.9, 3.9), 4e-3: (4.0, 4.0), 8e-3: (4.1, 4.1)})
    grown = lc.lr_sweep(STUDY, tmp_path, "2m", "diloco", dry=True)
    assert grown["best"] is None and grown["losses"]["0.001"] == [None, None]  # 1e-3 is asked for
    sweep_of(tmp_path, "2m", "diloco", {1e-3: (3.8, 3.8), 5e-4: (3.85, 3.85)})
    grown = lc.lr_sweep(STUDY, tmp_path, "2m", "diloco", dry=True)
    assert grown["best"] == 1e-3 and list(grown["losses"]) == ["0.0005", "0.001", "0.002", "0.004", "0.008"]


def test_the_record_fits_the_slope_to_rung_means_and_restores_its_runs(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    for rung in STUDY.rungs:
        for method in lc.METHODS:
            sweep_of(runs, rung, method, {2e-3: (4.0, 4.0), 4e-3: (3.9, 3.9), 8e-3: (4.1, 4.0)})
    means = {"ladder_ne33k": 0.16, "2m": 0.08, "ladder_ne359k": 0.05}
    for rung, mean in means.items():
        for seed, d in zip(STUDY.report_seeds, (-0.01, 0.0, 0.01)):
            summary(runs, (rung, "ddp", 4e-3, seed, "report"), 3.0)
            summary(runs, (rung, "diloco", 4e-3, seed, "report"), 3.0 * (1 + mean + d))
    lc.write_record(STUDY, runs, tmp_path / "out")
    record = json.loads((tmp_path / "out" / "summary.json").read_text())
    sizes = [lc.non_embedding(r) for r in STUDY.rungs]
    expected = LossGapLaw.fit(sizes, [100 * m for m in means.values()], 4).slope
    assert record["trend"]["non_embedding"]["slope"] == pytest.approx(expected)
    assert record["rungs"][1]["loss_gap"]["sd"] == pytest.approx(0.01, rel=1e-6)
    assert (
        "| 2m | 131,392 (262,464) | 1,290 (43) | 20.1 (10.1) |" in (tmp_path / "out" / "table.md").read_text()
    )
    fresh = tmp_path / "fresh"
    assert lc.restore(STUDY, fresh, tmp_path / "out" / "summary.json") == 3 * 2 * (3 * 2 + 3)
    lc.write_record(STUDY, fresh, tmp_path / "again")
    again = json.loads((tmp_path / "again" / "summary.json").read_text())
    assert again["rungs"] == record["rungs"] and again["trend"] == record["trend"]


def test_a_rung_not_run_says_so_and_no_slope_is_fitted_from_two_rungs(tmp_path):
    lc.write_record(STUDY, tmp_path / "none", tmp_path / "out")
    table = (tmp_path / "out" / "table.md").read_text()
    assert table.count("(not run)") == 3 and "Slope: not fitted" in table
    assert lc.restore(STUDY, tmp_path / "again", tmp_path / "out" / "summary.json") == 0  # nothing kept yet

"""The scaling-law yardstick (diloco.scaling_law) against an independent computation with numpy's
least squares, on the study's own table as results/reference.yaml holds it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from diloco import replication
from diloco.scaling_law import LossGapLaw, from_reference, t975

REFERENCE = yaml.safe_load((Path(__file__).resolve().parents[1] / "results" / "reference.yaml").read_text())


def numpy_prediction(params, gaps_pct, at):
    """The textbook prediction interval: lstsq on (1, log N), covariance s^2 (A^T A)^-1."""
    x, y = np.log(np.asarray(params, float)), np.log(np.asarray(gaps_pct, float) / 100)
    a = np.vstack([np.ones_like(x), x]).T
    coef, res, _, _ = np.linalg.lstsq(a, y, rcond=None)
    s2 = float(res[0]) / (len(x) - 2)
    cov = s2 * np.linalg.inv(a.T @ a)
    x0 = np.array([1.0, math.log(at)])
    mean, se = float(x0 @ coef), math.sqrt(float(x0 @ cov @ x0) + s2)
    half = 2.571 * se  # t(0.975, 5 dof): the table has 7 sizes
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


@pytest.mark.parametrize("workers", [4, 8])
@pytest.mark.parametrize("at", [2e5, 6.89e5, 3.74e6, 1.4e7, 1.8e8])
def test_the_fit_equals_numpys_least_squares_and_prediction_interval(workers, at):
    table = REFERENCE["scaling_law"]
    expected = numpy_prediction(table["params"], table["loss_gap_pct"][workers], at)
    got = from_reference(REFERENCE, workers).predict(at)
    assert (got.gap, got.low, got.high) == pytest.approx(expected, rel=1e-9)
    assert got.extrapolated == (at < 35e6)


def test_the_law_reproduces_its_own_table_within_its_intervals():
    table = REFERENCE["scaling_law"]
    for workers in (4, 8):
        law = from_reference(REFERENCE, workers)
        assert law.slope < 0  # the gap shrinks with size, as the study reports
        for n, g in zip(table["params"], table["loss_gap_pct"][workers]):
            p = law.predict(n)
            assert p.low < g / 100 < p.high and not p.extrapolated


def test_a_perfect_power_law_is_recovered_exactly():
    sizes = [1e6, 1e7, 1e8, 1e9]
    law = LossGapLaw.fit(sizes, [5.0 * (n / 1e6) ** -0.25 for n in sizes], workers=4)
    assert law.slope == pytest.approx(-0.25) and law.residual_var == pytest.approx(0, abs=1e-20)
    assert law.predict(1e5).gap == pytest.approx(0.05 * 10**0.25)


def test_columns_the_power_law_cannot_fit_are_refused_in_one_line():
    with pytest.raises(ValueError, match="M=2: a gap <= 0"):
        from_reference(REFERENCE, 2)
    with pytest.raises(ValueError, match="no column for M=16"):
        from_reference(REFERENCE, 16)


def test_t_quantiles():
    assert t975(5) == 2.571 and t975(10) == 2.228
    assert t975(30) == pytest.approx(2.042, abs=2e-3) and t975(120) == pytest.approx(1.980, abs=2e-3)


# ------------------------------------------------------------------------------- make check's yardstick
def fake_run(root: Path, name: str, reference: str, ppl: float, workers: int, params: int = 688_768):
    run = root / name
    run.mkdir(parents=True)
    summary = {
        "status": "completed",
        "step": 400,
        "num_workers": workers,
        "parameters": {"total": params, "non_embedding": params // 2},
        "tokens_seen": 20 * params,
        "config": {"launch": {"reference": reference, "family": "tiny"}},
    }
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 400, "eval/perplexity": ppl}) + "\n")


def judged(tmp_path: Path, gap: float, ddp_loss: float = 4.0) -> dict:
    fake_run(tmp_path, "ddp_mx", "tiny/ddp_mx", math.exp(ddp_loss), workers=1)
    fake_run(tmp_path, "diloco", "tiny/diloco_fp32", math.exp(ddp_loss * (1 + gap)), workers=4)
    return {v.id: v for v in replication.check(tmp_path, ["tiny"], replication.REFERENCE)}


LAW = from_reference(REFERENCE, 4)
UPPER = LAW.predict(688_768 // 2).high  # fake_run's non-embedding count: the claims' default N


@pytest.mark.parametrize(
    ("gap", "sign", "bound"),
    [(0.12, "PASS", "PASS"), (0.03, "PASS", "PASS"), (-0.01, "FAIL", "PASS"), (UPPER + 0.01, "PASS", "FAIL")],
)
def test_c1_is_one_sided_the_sign_and_the_laws_upper_bound_in_non_embedding_parameters(
    tmp_path, gap, sign, bound
):
    verdicts = judged(tmp_path, gap)
    assert (verdicts["C1-sign"].verdict, verdicts["C1-bound"].verdict) == (sign, bound)
    assert f"loss {4.0 * (1 + gap):.3f} vs 4.000: {gap:+.1%}" in verdicts["C1-sign"].measured
    expected = verdicts["C1-bound"].expected
    assert expected.startswith(f"gap <= {UPPER:+.1%}, the law's upper 95% bound")
    both = (LAW.predict(344_384).describe(), LAW.predict(688_768).describe())
    assert f"{both[0]} in non-embedding N; {both[1]} in total N" in expected
    assert (
        "decades below the study's 35M" in expected
        and "tokens per non-embedding parameter" in verdicts["C1-bound"].measured
    )
    centre = verdicts["C1-centre"]
    assert centre.verdict == "REPORTED" and centre.delta == f"{gap / LAW.predict(344_384).gap:.3f}"
    assert verdicts["C1-150m"].verdict == "NOT TESTED"


def test_the_law_claims_read_the_count_a_claim_names(tmp_path):
    reference = yaml.safe_load(replication.REFERENCE.read_text())
    for claim in reference["claims"]["tiny"]:
        if claim["id"] == "C1-bound":
            claim["params"] = "total"
    (tmp_path / "ref.yaml").write_text(yaml.safe_dump(reference))
    fake_run(tmp_path, "ddp_mx", "tiny/ddp_mx", math.exp(4.0), workers=1)
    fake_run(tmp_path, "diloco", "tiny/diloco_fp32", math.exp(4.0 * 1.1), workers=4)
    (bound,) = [v for v in replication.check(tmp_path, ["tiny"], tmp_path / "ref.yaml") if v.id == "C1-bound"]
    assert bound.expected.startswith(f"gap <= {LAW.predict(688_768).high:+.1%}")
    assert "tokens per total parameter" in bound.measured


def test_a_record_is_judged_with_its_own_reference_unless_told_otherwise(tmp_path):
    ppl = math.exp(4.0 * 1.03)  # +3% in loss: the ratio claim's pass, the law's fail
    fake_run(tmp_path, "ddp_mx", "tiny/ddp_mx", math.exp(4.0), workers=1)
    fake_run(tmp_path, "diloco", "tiny/diloco_fp32", ppl, workers=4)
    assert replication.reference_for([tmp_path]) == replication.REFERENCE
    ratio = {"id": "C1", "claim": "ratio", "kind": "ratio_within", "tolerance": 0.2}
    ratio |= {"a": "tiny/diloco_fp32", "b": "tiny/ddp_mx"}
    old = REFERENCE | {"claims": {"tiny": [ratio]}}
    (tmp_path / replication.RECORD_REFERENCE).write_text(yaml.safe_dump(old))
    assert replication.reference_for([tmp_path]) == tmp_path / replication.RECORD_REFERENCE
    assert [v.verdict for v in replication.check(tmp_path, ["tiny"]) if v.id == "C1"] == ["PASS"]
    today = replication.check(tmp_path, ["tiny"], replication.REFERENCE)
    assert [v.id for v in today if v.id.startswith("C1-")] == ["C1-sign", "C1-bound", "C1-centre", "C1-150m"]

"""The scaling-law yardstick (diloco.scaling_law) against an independent computation with numpy's
least squares, on the study's own table as results/reference.yaml holds it."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import yaml

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

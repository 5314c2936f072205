"""The scale-aware yardstick: the gap in evaluation loss between M-worker DiLoCo and data-parallel
training that the DiLoCo scaling-law study predicts for a model of N parameters.

Charles et al. 2025 ("Scaling Laws for DiLoCo", arXiv 2503.09799), Table 4, measures that gap from 35M
to 2.4B parameters, each method at its own best inner lr and global batch, 20 tokens per parameter,
H=30, on C4. Its points are copied into `results/reference.yaml` (`scaling_law`). For M=4 and M=8 every
gap is positive and log(gap) falls on a line in log(N); `LossGapLaw` fits that line by ordinary least
squares and predicts at N with a 95% prediction interval (Student t with n-2 degrees of freedom, the
fit's residual variance plus the parameters' covariance). Below 35M the prediction is an extrapolation:
the interval widens with the distance in log(N), and `extrapolated` says so.

Invariants: the fit uses only the table's points (nothing of ours); a gap is a fraction of the
data-parallel loss (0.02 = +2%); perplexity ratios follow as exp(gap x loss).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Student t quantiles at 0.975 for 1-10 degrees of freedom (a table of the study has 7 sizes: 5).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def t975(dof: int) -> float:
    """The 97.5% quantile of Student's t (exact to 3 decimals up to 10 degrees of freedom; beyond,
    the Cornish-Fisher expansion around the normal quantile, within 0.002)."""
    if dof < 1:
        raise ValueError("a prediction interval needs at least one degree of freedom (3 points)")
    if dof in _T975:
        return _T975[dof]
    z = 1.959964
    return z + (z**3 + z) / (4 * dof) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)


@dataclass(frozen=True)
class Prediction:
    """The predicted loss gap at one size, as fractions of the data-parallel loss."""

    params: float
    workers: int
    gap: float
    low: float  # the 95% prediction interval
    high: float
    extrapolated: bool  # N outside the table's sizes

    def describe(self) -> str:
        where = "extrapolated" if self.extrapolated else "interpolated"
        return (
            f"{self.gap:+.1%} [{self.low:+.1%}, {self.high:+.1%}] at {_size(self.params)}, "
            f"M={self.workers} ({where})"
        )


@dataclass(frozen=True)
class LossGapLaw:
    """log(gap) = intercept + slope * log(N), fitted to one M's column of the study's table."""

    workers: int
    intercept: float
    slope: float
    residual_var: float
    cov: tuple[tuple[float, float], tuple[float, float]]  # of (intercept, slope)
    dof: int
    sizes: tuple[float, float]  # the smallest and largest N of the table

    @classmethod
    def fit(cls, params: list[float], gaps_pct: list[float], workers: int) -> LossGapLaw:
        """Least squares on (log N, log gap); `gaps_pct` in percent, as the table prints them."""
        if len(params) != len(gaps_pct) or len(params) < 3:
            raise ValueError("the fit needs at least 3 sizes, each with its gap")
        if min(gaps_pct) <= 0:
            raise ValueError(f"M={workers}: a gap <= 0 has no logarithm; the power law fits M=4 and M=8")
        xs = [math.log(n) for n in params]
        ys = [math.log(g / 100) for g in gaps_pct]
        n = len(xs)
        mean_x, mean_y = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mean_x) ** 2 for x in xs)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx
        intercept = mean_y - slope * mean_x
        residual_var = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys)) / (n - 2)
        var_slope = residual_var / sxx
        cov_ab = -mean_x * var_slope
        var_intercept = residual_var / n + mean_x**2 * var_slope
        cov = ((var_intercept, cov_ab), (cov_ab, var_slope))
        return cls(workers, intercept, slope, residual_var, cov, n - 2, (min(params), max(params)))

    def slope_interval(self) -> tuple[float, float]:
        """The 95% confidence interval of the fitted slope (Student t with the fit's dof)."""
        half = t975(self.dof) * math.sqrt(self.cov[1][1])
        return self.slope - half, self.slope + half

    def predict(self, params: float) -> Prediction:
        """The gap at `params` with its 95% prediction interval (a new point's, not the mean line's)."""
        x = math.log(params)
        (va, cab), (_, vb) = self.cov
        mean = self.intercept + self.slope * x
        se = math.sqrt(va + 2 * x * cab + x * x * vb + self.residual_var)
        half = t975(self.dof) * se
        outside = not self.sizes[0] <= params <= self.sizes[1]
        return Prediction(
            params, self.workers, math.exp(mean), math.exp(mean - half), math.exp(mean + half), outside
        )


def from_reference(reference: dict, workers: int) -> LossGapLaw:
    """The law for M=`workers` from results/reference.yaml's `scaling_law` block."""
    table = reference.get("scaling_law")
    if not table:
        raise ValueError("results/reference.yaml has no scaling_law block")
    gaps = table["loss_gap_pct"].get(workers) or table["loss_gap_pct"].get(str(workers))
    if gaps is None:
        known = ", ".join(str(m) for m in table["loss_gap_pct"])
        raise ValueError(f"the scaling-law table has no column for M={workers} (it has M={known})")
    return LossGapLaw.fit([float(n) for n in table["params"]], [float(g) for g in gaps], workers)


def _size(params: float) -> str:
    return f"{params / 1e9:.2g}B" if params >= 1e9 else f"{params / 1e6:.3g}M"

"""Across-seed statistics: the mean with a two-sided t confidence interval, and Welch's interval for the
difference of two group means (unequal variances). Seeds are the replicates; n is small (3-5), which is why the
t quantile and not 1.96 is used.

Formulas: mean ± t_{1-α/2, n-1} · s/√n with s the sample standard deviation (ddof=1). Welch: diff = ā - b̄,
se = √(s_a²/n_a + s_b²/n_b), ν = se⁴ / ((s_a²/n_a)²/(n_a-1) + (s_b²/n_b)²/(n_b-1)) (Welch-Satterthwaite),
interval diff ± t_{1-α/2, ν} · se. (Welch 1947, Biometrika 34:28-35.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from scipy import stats as _st


@dataclass(frozen=True)
class Interval:
    mean: float
    lo: float
    hi: float
    n: int
    dof: float = float("nan")

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2

    def fmt(self, digits: int = 3) -> str:
        if self.n == 0:
            return "-"
        if not math.isfinite(self.lo):
            return f"{self.mean:.{digits}f} (n={self.n}, no CI)"
        return f"{self.mean:.{digits}f} ± {self.half_width:.{digits}f} (n={self.n})"


def _var(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)


def mean_ci(xs: list[float], level: float = 0.95) -> Interval:
    """Mean and t interval; with one value the interval is undefined (nan bounds)."""
    n = len(xs)
    if n == 0:
        return Interval(float("nan"), float("nan"), float("nan"), 0)
    m = sum(xs) / n
    if n == 1:
        return Interval(m, float("nan"), float("nan"), 1)
    half = float(_st.t.ppf(0.5 + level / 2, n - 1)) * math.sqrt(_var(xs) / n)
    return Interval(m, m - half, m + half, n, dof=n - 1)


def welch_diff(a: list[float], b: list[float], level: float = 0.95) -> Interval:
    """mean(a) - mean(b) with Welch's interval; needs ≥2 values on each side."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"a difference with a confidence interval needs at least 2 seeds per group "
                         f"(got {len(a)} and {len(b)}); add seeds with --seeds")
    va, vb = _var(a) / len(a), _var(b) / len(b)
    diff = sum(a) / len(a) - sum(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:  # identical replicates on both sides: the difference is exact
        return Interval(diff, diff, diff, len(a) + len(b), dof=float("inf"))
    dof = se ** 4 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half = float(_st.t.ppf(0.5 + level / 2, dof)) * se
    return Interval(diff, diff - half, diff + half, len(a) + len(b), dof=dof)


def band(series: list[tuple[list[int], list[float]]], level: float = 0.95) -> tuple[list[int], list[Interval]]:
    """Per-step mean and CI over seeds, at the steps every seed logged (a seed that stopped early would
    otherwise bend the mean where it drops out)."""
    if not series:
        return [], []
    common = sorted(set.intersection(*(set(s) for s, _ in series)))
    lookup = [dict(zip(s, v)) for s, v in series]
    return common, [mean_ci([d[step] for d in lookup], level) for step in common]

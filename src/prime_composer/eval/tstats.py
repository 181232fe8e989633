"""Means over seeds with Student-t intervals, and paired differences against a baseline.

A handful of seeds is far too few for the normal approximation: with 3 seeds the two-sided 95%
quantile is 4.303, not 1.96. The quantile is computed here, without scipy: the t distribution's
CDF is ``1 - I_x(df/2, 1/2) / 2`` for ``t > 0`` with ``x = df / (df + t^2)`` (the regularized
incomplete beta function, evaluated by its continued fraction, Numerical Recipes §6.4), and the
quantile is found by bisection on it.

    interval = mean +- t_{0.975, n-1} * s / sqrt(n)

A paired difference is the same interval over the per-seed differences ``arm_s - baseline_s``
(seeds where both ran), which removes the part of the seed-to-seed spread the arms share.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from statistics import fmean, stdev
from typing import Any


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"betainc: x = {x} is outside [0, 1]")
    if x in (0.0, 1.0):
        return x
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"t_cdf: df = {df} must be > 0")
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on the CDF)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p = {p} must be in (0, 1)")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        high *= 2.0
    for _ in range(200):
        mid = (low + high) / 2.0
        if t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
        if high - low < 1e-12 * max(1.0, high):
            break
    return (low + high) / 2.0


@dataclass(frozen=True)
class TInterval:
    n: int
    mean: float | None
    ci_low: float | None
    ci_high: float | None
    """``None`` bounds: fewer than two values (no spread to estimate); ``None`` mean: no values."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def fmt(self, digits: int = 3) -> str:
        if self.mean is None:
            return "-"
        if self.ci_low is None or self.ci_high is None:
            return f"{self.mean:.{digits}f} (n={self.n})"
        return f"{self.mean:.{digits}f} [{self.ci_low:.{digits}f}, {self.ci_high:.{digits}f}]"


def t_interval(values: Sequence[float], confidence: float = 0.95) -> TInterval:
    """Mean of ``values`` and its two-sided Student-t interval (n - 1 degrees of freedom)."""
    n = len(values)
    if n == 0:
        return TInterval(0, None, None, None)
    mean = fmean(values)
    if n < 2:
        return TInterval(1, mean, None, None)
    half = t_quantile(0.5 + confidence / 2.0, n - 1) * stdev(values) / math.sqrt(n)
    return TInterval(n, mean, mean - half, mean + half)


def paired_difference(
    arm: dict[int, float], baseline: dict[int, float], confidence: float = 0.95
) -> TInterval:
    """``t_interval`` of ``arm[seed] - baseline[seed]`` over the seeds both have."""
    seeds = sorted(set(arm) & set(baseline))
    return t_interval([arm[s] - baseline[s] for s in seeds], confidence)

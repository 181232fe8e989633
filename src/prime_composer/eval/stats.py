"""Accuracy with a 95% confidence interval, and pass@k, from per-task sample outcomes.

- **One sample per task**: accuracy is the fraction of tasks solved, a binomial proportion; its
  interval is the **Wilson score interval** (Wilson 1927), which unlike the normal approximation
  stays inside [0, 1] and does not collapse to a point at 0% or 100% accuracy on a small eval:

      center = (p + z^2 / 2n) / (1 + z^2 / n),  half = z sqrt(p (1 - p) / n + z^2 / 4n^2) / (1 + z^2 / n)

- **k samples per task**: accuracy is the mean over tasks of each task's solved fraction (the
  pass@1 estimate); the samples of one task are not independent, so the interval is the **normal
  approximation over tasks**, ``mean +- z s / sqrt(n)`` with ``s`` the sample standard deviation of
  the per-task fractions (clipped to [0, 1]).
- **pass@k**: the unbiased estimator of Chen et al. (2021), averaged over tasks: for a task with
  ``n`` samples of which ``c`` are correct, ``1 - C(n - c, k) / C(n, k)``, computed as a product
  (no huge binomials).

The mean reward gets the normal interval over tasks as well (rewards need not be 0 or 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from statistics import fmean, stdev
from typing import Any

Z_95 = 1.959963984540054
"""The standard normal quantile of 0.975: two-sided 95%."""


@dataclass(frozen=True)
class Interval:
    mean: float
    ci_low: float
    ci_high: float
    method: str
    """``wilson``, ``normal``, or ``none`` (fewer than two tasks for a normal interval)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def wilson_interval(successes: int, n: int, z: float = Z_95) -> Interval:
    """The Wilson score interval of ``successes`` out of ``n`` Bernoulli trials."""
    if n <= 0 or not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: need 0 <= successes <= n and n > 0, got {successes}/{n}")
    p = successes / n
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return Interval(p, max(0.0, center - half), min(1.0, center + half), "wilson")


def normal_interval(
    values: Sequence[float], z: float = Z_95, bounds: tuple[float, float] | None = (0.0, 1.0)
) -> Interval:
    """``mean +- z * stdev / sqrt(n)`` over ``values`` (clipped to ``bounds`` unless None)."""
    if not values:
        raise ValueError("normal_interval: no values")
    mean = fmean(values)
    if len(values) < 2:
        low, high = bounds if bounds is not None else (-math.inf, math.inf)
        return Interval(mean, low, high, "none")
    half = z * stdev(values) / math.sqrt(len(values))
    low, high = mean - half, mean + half
    if bounds is not None:
        low, high = max(bounds[0], low), min(bounds[1], high)
    return Interval(mean, low, high, "normal")


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Chance that at least one of ``k`` samples drawn without replacement from ``num_samples``
    (``num_correct`` of them correct) is correct."""
    if not 1 <= k <= num_samples or not 0 <= num_correct <= num_samples:
        raise ValueError(
            f"pass_at_k: need 1 <= k <= n and 0 <= c <= n, got n={num_samples} c={num_correct} k={k}"
        )
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(num_samples - num_correct + 1, num_samples + 1))


def ks_to_report(num_samples: int) -> list[int]:
    """1, 2, 4, ... up to ``num_samples``, and ``num_samples`` itself."""
    ks = [1 << i for i in range(num_samples.bit_length()) if 1 << i <= num_samples]
    return ks if ks[-1] == num_samples else [*ks, num_samples]


def summarize(tasks: Sequence[tuple[int, int, float]]) -> dict[str, Any]:
    """Summary of ``(num_samples, num_correct, mean_reward)`` per task (every task has the same
    number of samples)."""
    if not tasks:
        return {"n": 0}
    k = tasks[0][0]
    if any(t[0] != k for t in tasks):
        raise ValueError("summarize: every task needs the same number of samples")
    if k == 1:
        accuracy = wilson_interval(sum(c for _, c, _ in tasks), len(tasks))
    else:
        accuracy = normal_interval([c / k for _, c, _ in tasks])
    return {
        "n": len(tasks),
        "num_samples": k * len(tasks),
        "accuracy": accuracy.as_dict(),
        "reward": normal_interval([r for _, _, r in tasks], bounds=None).as_dict(),
        "pass_at_k": {str(j): fmean(pass_at_k(k, c, j) for _, c, _ in tasks) for j in ks_to_report(k)},
    }

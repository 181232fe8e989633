"""``eval``'s statistics against independent computations: the Wilson interval as the roots of its
defining quadratic, pass@k by enumerating every k-subset of the samples, the normal interval from
its textbook formula on hand-picked numbers."""

from __future__ import annotations

import itertools
import math

import pytest

from prime_composer.eval.stats import (
    Z_95,
    ks_to_report,
    normal_interval,
    pass_at_k,
    summarize,
    wilson_interval,
)


@pytest.mark.parametrize(("successes", "n"), [(0, 10), (3, 10), (10, 10), (1, 1), (57, 200)])
def test_wilson_bounds_are_the_roots_of_the_score_equation(successes: int, n: int) -> None:
    # The Wilson interval is every p0 with |p_hat - p0| <= z sqrt(p0 (1 - p0) / n): squaring gives
    # (1 + z^2/n) p0^2 - (2 p_hat + z^2/n) p0 + p_hat^2 = 0, whose roots are the bounds.
    p_hat, z2 = successes / n, Z_95**2
    a, b, c = 1 + z2 / n, -(2 * p_hat + z2 / n), p_hat**2
    root = math.sqrt(b * b - 4 * a * c)
    interval = wilson_interval(successes, n)
    assert interval.mean == pytest.approx(p_hat)
    assert interval.ci_low == pytest.approx(max(0.0, (-b - root) / (2 * a)), abs=1e-12)
    assert interval.ci_high == pytest.approx(min(1.0, (-b + root) / (2 * a)), abs=1e-12)
    assert interval.method == "wilson"


def test_wilson_does_not_collapse_at_zero_or_full_accuracy() -> None:
    # 0 of 10 and 10 of 10: the normal approximation would give [0, 0] and [1, 1].
    assert wilson_interval(0, 10).ci_high == pytest.approx(0.2775, abs=1e-4)
    assert wilson_interval(10, 10).ci_low == pytest.approx(0.7225, abs=1e-4)


@pytest.mark.parametrize(("n", "c"), [(1, 0), (1, 1), (4, 1), (5, 2), (6, 6), (7, 3), (8, 0)])
def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_correct_sample(n: int, c: int) -> None:
    samples = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(samples, k))
        expected = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)


def test_normal_interval_by_hand() -> None:
    # values 0, 0.5, 1: mean 0.5, sample stdev 0.5, half width 1.96 * 0.5 / sqrt(3) = 0.5658 (clipped).
    interval = normal_interval([0.0, 0.5, 1.0])
    assert interval.mean == pytest.approx(0.5)
    assert interval.ci_low == 0.0 and interval.ci_high == 1.0  # clipped
    unclipped = normal_interval([0.0, 0.5, 1.0], bounds=None)
    assert unclipped.ci_high - 0.5 == pytest.approx(Z_95 * 0.5 / math.sqrt(3))
    assert normal_interval([0.25]).method == "none"


def test_summarize_one_and_several_samples() -> None:
    one = summarize([(1, 1, 1.0), (1, 0, 0.0), (1, 1, 1.0), (1, 0, 0.2)])
    assert one["n"] == 4 and one["num_samples"] == 4
    assert one["accuracy"]["mean"] == 0.5 and one["accuracy"]["method"] == "wilson"
    assert one["reward"]["mean"] == pytest.approx(0.55)
    assert one["pass_at_k"] == {"1": 0.5}

    # Two tasks, 4 samples each: 1 and 3 correct. pass@1 = mean(1/4, 3/4); pass@2 = mean(1 - C(3,2)/C(4,2),
    # 1 - 0) = mean(0.5, 1); pass@4 = 1 for both.
    several = summarize([(4, 1, 0.25), (4, 3, 0.75)])
    assert several["accuracy"]["mean"] == 0.5 and several["accuracy"]["method"] == "normal"
    assert several["pass_at_k"] == pytest.approx({"1": 0.5, "2": 0.75, "4": 1.0})
    with pytest.raises(ValueError, match="same number of samples"):
        summarize([(4, 1, 0.25), (2, 1, 0.5)])


def test_ks_to_report() -> None:
    assert ks_to_report(1) == [1]
    assert ks_to_report(8) == [1, 2, 4, 8]
    assert ks_to_report(6) == [1, 2, 4, 6]


def test_bad_counts_are_errors() -> None:
    with pytest.raises(ValueError, match="successes <= n"):
        wilson_interval(3, 2)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)

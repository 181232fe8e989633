"""Advantages and dynamic-sampling filter, checked against numbers worked out by hand."""

from __future__ import annotations

import pytest

from prime_composer.config.advantage import AdvantageConfig
from prime_composer.orchestrator.advantages import compute_advantages, filter_zero_variance, overlong_penalty
from prime_composer.orchestrator.sample import Sample


def make(reward: float, group_id: int, num_completion: int = 3) -> Sample:
    return Sample(
        prompt_ids=[1, 2],
        completion_ids=[5] * num_completion,
        completion_logprobs=[-0.1] * num_completion,
        completion_mask=[1] * num_completion,
        reward=reward,
        example_id=group_id,
        group_id=group_id,
        policy_step=0,
    )


def test_group_mean_baseline_interleaved_groups() -> None:
    # group 0: rewards 1, 0, 0, 1 -> mean 0.5; group 7: 1, 0, 0.5 -> mean 0.5
    samples = [make(1, 0), make(1, 7), make(0, 0), make(0, 7), make(0, 0), make(0.5, 7), make(1, 0)]
    out = compute_advantages(samples, AdvantageConfig())
    assert [s.advantage for s in out] == [0.5, 0.5, -0.5, -0.5, -0.5, 0.0, 0.5]
    assert [s.group_id for s in out] == [s.group_id for s in samples]
    assert all(s.advantage == 0.0 for s in samples), "inputs must not be modified"


def test_std_scaling_uses_sample_std() -> None:
    # rewards 1, 0, 0, 1: deviations +-0.5, sample variance 4 * 0.25 / 3 = 1/3
    out = compute_advantages([make(r, 0) for r in (1, 0, 0, 1)], AdvantageConfig(std_scaling=True))
    expected = 0.5 / (3**-0.5 + 1e-4)
    assert [s.advantage for s in out] == pytest.approx([expected, -expected, -expected, expected], rel=1e-12)
    # rewards 2, 4: mean 3, sample std sqrt(2)
    out = compute_advantages([make(2, 0), make(4, 0)], AdvantageConfig(std_scaling=True))
    assert out[1].advantage == pytest.approx(1 / (2**0.5 + 1e-4), rel=1e-12)


def test_equal_rewards_give_exact_zero_and_are_filtered() -> None:
    # 0.1 * 3 is not exactly 0.3 in floating point: the all-equal case must still give exact 0.
    samples = [make(0.1, 1), make(0.1, 1), make(0.1, 1), make(1, 2), make(0, 2), make(1, 3)]
    for std_scaling in (False, True):
        out = compute_advantages(samples, AdvantageConfig(std_scaling=std_scaling))
        assert [s.advantage for s in out[:3]] == [0.0, 0.0, 0.0]
        kept, num_dropped = filter_zero_variance(out)
        # group 1 (all 0.1) and group 3 (a single sample) carry no signal
        assert num_dropped == 2
        assert [s.group_id for s in kept] == [2, 2]


@pytest.mark.parametrize(
    ("num_tokens", "expected"),
    [(0, 0.0), (6, 0.0), (7, -0.25), (8, -0.5), (9, -0.75), (10, -1.0), (13, -1.0)],
)
def test_overlong_penalty_dapo_shape(num_tokens: int, expected: float) -> None:
    # max_tokens 10, buffer 4: free up to 6 tokens, then -1/4 per token down to -1 at 10
    assert overlong_penalty(num_tokens, max_tokens=10, buffer=4, penalty=1.0) == pytest.approx(expected)
    assert overlong_penalty(num_tokens, max_tokens=10, buffer=4, penalty=0.5) == pytest.approx(expected / 2)
    assert overlong_penalty(num_tokens, max_tokens=10, buffer=0, penalty=1.0) == 0.0


def test_overlong_penalty_enters_the_baseline() -> None:
    cfg = AdvantageConfig(overlong_buffer=4, overlong_penalty=1.0)
    # both reward 1; 8 tokens costs 0.5 -> shaped 1 and 0.5, mean 0.75
    out = compute_advantages([make(1, 0, num_completion=6), make(1, 0, num_completion=8)], cfg, max_tokens=10)
    assert [s.advantage for s in out] == pytest.approx([0.25, -0.25])
    assert [s.metrics["overlong_penalty"] for s in out] == pytest.approx([0.0, -0.5])
    assert [s.reward for s in out] == [1, 1]
    kept, num_dropped = filter_zero_variance(out)
    assert (len(kept), num_dropped) == (2, 0)


def test_overlong_penalty_needs_max_tokens() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        compute_advantages([make(1, 0)], AdvantageConfig(overlong_buffer=4))
    with pytest.raises(ValueError, match="overlong_buffer"):
        compute_advantages([make(1, 0)], AdvantageConfig(overlong_buffer=40), max_tokens=10)

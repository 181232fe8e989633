"""Turning server answers into Sample tokens, and per-request sampling fields (no server)."""

from __future__ import annotations

import math

import pytest

from prime_composer.config.advantage import AdvantageConfig
from prime_composer.config.env import SamplingConfig
from prime_composer.orchestrator.advantages import compute_advantages
from prime_composer.orchestrator.harness import TurnRecord, turn_record
from prime_composer.orchestrator.record import EpisodeRecord
from prime_composer.orchestrator.rollout import (
    TokenError,
    assemble_tokens,
    derive_seed,
    request_sampling,
)
from prime_composer.orchestrator.sample import Sample


def _turn(prompt: list[int], completion: list[int], logprobs: list[float] | None) -> TurnRecord:
    return TurnRecord(
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        completion_logprobs=logprobs,
        finish_reason="stop",
        content="",
    )


def test_turn_record_reads_vllm_return_token_ids_json() -> None:
    completion = {
        "prompt_token_ids": [5, 6, 7],
        "choices": [
            {
                "message": {"role": "assistant", "content": "12"},
                "finish_reason": "length",
                "token_ids": [49, 50],
                "logprobs": {
                    "content": [
                        {"token": "1", "logprob": -0.25, "bytes": [49], "top_logprobs": []},
                        {"token": "2", "logprob": -1.5, "bytes": [50], "top_logprobs": []},
                    ]
                },
            }
        ],
    }
    assert turn_record(completion) == {
        "prompt_token_ids": [5, 6, 7],
        "completion_token_ids": [49, 50],
        "completion_logprobs": [-0.25, -1.5],
        "finish_reason": "length",
        "content": "12",
    }
    entries = completion["choices"][0]["logprobs"]["content"]
    for bad in (None, float("nan"), -9999.0):  # missing, non-finite, vLLM's "no evidence" value
        entries[1]["logprob"] = bad
        assert turn_record(completion)["completion_logprobs"] is None
    del completion["choices"][0]["logprobs"]
    assert turn_record(completion)["completion_logprobs"] is None


def test_single_turn() -> None:
    (segment,) = assemble_tokens([_turn([1, 2, 3], [10, 11], [-0.1, -0.2])])
    assert (segment.prompt_ids, segment.completion_ids, segment.logprobs, segment.mask) == (
        [1, 2, 3],
        [10, 11],
        [-0.1, -0.2],
        [1, 1],
    )
    assert segment.spans == [(0, 2)] and segment.turns == [0]


def test_multi_turn_splices_environment_tokens_with_mask_zero() -> None:
    # Turn 1's prompt = turn 0's prompt + its completion + [20, 21] (e.g. "\n<user msg>").
    turns = [
        _turn([1, 2], [10, 11], [-0.1, -0.2]),
        _turn([1, 2, 10, 11, 20, 21], [12], [-0.3]),
    ]
    (segment,) = assemble_tokens(turns)
    assert segment.prompt_ids == [1, 2]
    assert segment.completion_ids == [10, 11, 20, 21, 12]
    assert segment.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert segment.mask == [1, 1, 0, 0, 1]
    assert segment.spans == [(0, 2), (4, 5)]


def test_a_prompt_that_does_not_extend_the_previous_turn_starts_a_new_sample() -> None:
    # PRIME-RL's rule: a template that rewrites history splits the rollout instead of failing it.
    turns = [
        _turn([1, 2], [10, 11], [-0.1, -0.2]),
        _turn([1, 2, 10, 99, 20], [12], [-0.3]),
        _turn([1, 2, 10, 99, 20, 12, 30], [13, 14], [-0.4, -0.5]),
    ]
    first, second = assemble_tokens(turns)
    assert (first.prompt_ids, first.completion_ids, first.mask, first.turns) == (
        [1, 2],
        [10, 11],
        [1, 1],
        [0],
    )
    assert second.prompt_ids == [1, 2, 10, 99, 20]
    assert second.completion_ids == [12, 30, 13, 14] and second.mask == [1, 0, 1, 1]
    assert second.logprobs == [-0.3, 0.0, -0.4, -0.5]
    assert second.turns == [1, 2] and second.spans == [(0, 1), (2, 4)]


@pytest.mark.parametrize(
    ("turn", "message"),
    [
        (_turn([1], [10], None), "no logprobs"),
        (_turn([1], [10, 11], [-0.1]), "2 completion token ids but 1 logprobs"),
        (
            TurnRecord(
                prompt_token_ids=None,
                completion_token_ids=[1],
                completion_logprobs=[0.0],
                finish_reason="stop",
                content="",
            ),
            "no token ids",
        ),
    ],
)
def test_missing_evidence_is_an_error(turn: TurnRecord, message: str) -> None:
    with pytest.raises(TokenError, match=message):
        assemble_tokens([turn])


def test_seed_is_sent_only_when_asked_and_differs_per_rollout() -> None:
    fields = request_sampling(SamplingConfig(max_tokens=8), group_id=3, rollout_index=0).model_dump(
        exclude_none=True
    )
    assert fields == {"temperature": 1.0, "top_p": 1.0, "max_tokens": 8}
    seeded = [
        request_sampling(SamplingConfig(seed=7), group_id=g, rollout_index=i).model_dump()["seed"]
        for g in range(3)
        for i in range(4)
    ]
    assert len(set(seeded)) == len(seeded)
    assert all(0 <= s < 2**31 for s in seeded)
    assert derive_seed(7, 1, 2) == derive_seed(7, 1, 2) != derive_seed(8, 1, 2)


def test_extra_body_and_optional_fields_pass_through() -> None:
    sampling = SamplingConfig(top_k=5, stop=["\n"], extra_body={"min_tokens": 1})
    fields = request_sampling(sampling, group_id=0, rollout_index=0).model_dump(exclude_none=True)
    assert fields["top_k"] == 5 and fields["stop"] == ["\n"] and fields["min_tokens"] == 1
    assert "min_p" not in fields and "seed" not in fields


def test_the_samples_of_a_split_episode_count_once_in_the_group_baseline() -> None:
    def sample(trace: str, reward: float) -> Sample:
        return Sample(
            [1],
            [2],
            [0.0],
            [1],
            reward,
            example_id=0,
            group_id=5,
            policy_step=0,
            episode=EpisodeRecord(trace_id=trace),
        )

    group = [sample("a", 1.0), sample("a", 1.0), sample("b", 0.0), sample("c", 0.0)]
    plain = compute_advantages(group, AdvantageConfig(std_scaling=False))
    # Episodes a, b, c: mean 1/3, so a's two samples get 2/3 each (not 1/2, as four rollouts would).
    assert [s.advantage for s in plain] == pytest.approx([2 / 3, 2 / 3, -1 / 3, -1 / 3])
    scaled = compute_advantages(group, AdvantageConfig(std_scaling=True))
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # over the three episodes, n - 1
    assert scaled[0].advantage == pytest.approx((2 / 3) / (std + 1e-4))

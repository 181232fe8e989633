"""The typed episode record and the one converter from Samples to the teacher's traces.

An episode split over two Samples (same ``trace_id``, per-turn records) becomes one trace whose
assistant turns carry each Sample's own tokens; a Sample without per-turn records becomes a trace of
its messages; a failed Sample none. The expected traces are written out by hand."""

from __future__ import annotations

import pytest

from prime_composer.orchestrator.episode import TurnInfo
from prime_composer.orchestrator.record import EpisodeRecord
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.trace_export import episode_key, samples_to_traces

MESSAGES = [
    {"role": "user", "content": "fix it"},
    {"role": "assistant", "content": "a"},
    {"role": "user", "content": "more"},
    {"role": "assistant", "content": "b"},
]


def _segment(number: int, prompt: list[int], completion: list[int], turn: TurnInfo) -> Sample:
    return Sample(
        prompt_ids=prompt,
        completion_ids=completion,
        completion_logprobs=[-0.5] * len(completion),
        completion_mask=[1] * len(completion),
        reward=1.0,
        example_id=0,
        group_id=0,
        policy_step=0,
        episode=EpisodeRecord(
            env="e",
            trace_id="t1",
            task={"prompt": "fix it"},
            messages=MESSAGES,
            turns=[turn],
            stop="final_answer",
            segment=number,
            num_segments=2,
        ),
    )


def test_split_episode_plain_sample_and_error_sample() -> None:
    first = _segment(0, [1, 2], [3, 4], TurnInfo(index=0, span=(0, 2), message_index=1, finish_reason="stop"))
    second = _segment(
        1, [9], [5, 6, 7], TurnInfo(index=1, span=(1, 3), message_index=3, finish_reason="stop")
    )
    plain = Sample(
        [1], [8], [-0.25], [1], 0.0, 1, 1, 0, episode=EpisodeRecord(messages=MESSAGES[:2], trace_id="p")
    )
    failed = Sample(
        [1], [], [], [], 0.0, 2, 2, 0, error="boom", episode=EpisodeRecord(trace_id="x", turns=[])
    )
    assert [episode_key(s) for s in (first, second, plain, failed)] == ["t1", "t1", None, "x"]

    traces = samples_to_traces([first, plain, second, failed])  # in order of first appearance
    assert traces == [
        {
            "id": "t1",
            "task": "fix it",
            "tools": [],
            "turns": [
                {"role": "user", "content": "fix it"},
                {"role": "assistant", "content": "a", "tool_calls": [], "token_ids": [3, 4],
                 "prompt_token_ids": [1, 2], "logprobs": [-0.5, -0.5]},
                {"role": "user", "content": "more"},
                {"role": "assistant", "content": "b", "tool_calls": [], "token_ids": [6, 7],
                 "prompt_token_ids": [9, 5], "logprobs": [-0.5, -0.5]},
            ],
            "reward": 1.0,
            "info": {"env": "e", "task_id": None, "stop": "final_answer"},
        },
        {
            "id": "p",
            "task": {},
            "tools": [],
            "turns": [
                {"role": "user", "content": "fix it"},
                {"role": "assistant", "content": "a", "tool_calls": [], "token_ids": [8],
                 "prompt_token_ids": [1], "logprobs": [-0.25]},
            ],
            "reward": 0.0,
            "info": {"env": "env", "task_id": None, "stop": None},
        },
    ]  # fmt: skip


def test_a_misspelled_field_is_an_error_not_a_silent_key() -> None:
    with pytest.raises(TypeError, match="trace_idd"):
        EpisodeRecord(trace_idd="t")  # type: ignore[call-arg]


def test_a_sample_without_turn_records_goes_through_the_same_converter() -> None:
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]

    def sample(mask: list[int], turns: list[TurnInfo] | None) -> Sample:
        episode = EpisodeRecord(messages=messages, trace_id="q", turns=turns)
        return Sample([1, 2], [7, 8, 9], [-0.1, -0.2, -0.3], mask, 1.0, 0, 0, 0, episode=episode)

    by_hand = samples_to_traces([sample([0, 1, 1], None)])
    recorded = samples_to_traces(
        [sample([0, 1, 1], [TurnInfo(index=0, span=(1, 3), message_index=1, finish_reason=None)])]
    )
    assert by_hand == recorded
    (turn,) = [t for t in by_hand[0]["turns"] if t["role"] == "assistant"]
    assert (turn["prompt_token_ids"], turn["token_ids"], turn["logprobs"]) == (
        [1, 2, 7],
        [8, 9],
        [-0.2, -0.3],
    )
    # Policy tokens in two runs can't be one action: the turn keeps its text, no tokens.
    (split,) = samples_to_traces([sample([1, 0, 1], None)])
    assert "token_ids" not in split["turns"][-1]

"""The token-in client's reading of ``/inference/v1/generate`` answers and the fields it sends."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from prime_composer.orchestrator.episode import Generation, ModelCallError
from prime_composer.orchestrator.generate import TokenPolicy, parse_generation, server_root, turn_seed


def answer(token_ids: list[int], logprobs: list[Any], finish: str | None = "stop") -> dict[str, Any]:
    content = [
        {"token": f"token_id:{t}", "logprob": lp, "top_logprobs": []}
        for t, lp in zip(token_ids, logprobs, strict=False)  # may differ in length
    ]
    return {
        "choices": [
            {"index": 0, "token_ids": token_ids, "logprobs": {"content": content}, "finish_reason": finish}
        ]
    }


def test_a_generate_answer_becomes_a_generation() -> None:
    assert parse_generation(answer([5, 6], [-0.5, -1.25], "length")) == Generation(
        [5, 6], [-0.5, -1.25], "length"
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"choices": []}, "no choices"),
        ({"choices": [{"token_ids": [1], "logprobs": None}]}, "no logprobs"),
        (answer([1, 2], [-0.1]), "2 token ids but 1 logprobs"),
        (answer([1], [-9999.0]), "no evidence"),
        (answer([1], [float("nan")]), "no evidence"),
        (answer([1], [None]), "not a number"),
        ({"choices": [{"token_ids": ["a"], "logprobs": {"content": []}}]}, "not a list of token ids"),
    ],
)
def test_answers_without_evidence_are_model_call_errors(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelCallError, match=message):
        parse_generation(data)


def test_the_server_root_and_per_turn_seeds() -> None:
    assert (
        server_root("http://127.0.0.1:8000/v1")
        == server_root("http://127.0.0.1:8000/v1/")
        == "http://127.0.0.1:8000"
    )
    assert server_root("http://h:1") == "http://h:1"
    seeds = {turn_seed(7, k) for k in range(50)}
    assert len(seeds) == 50 and all(0 <= s < 2**31 for s in seeds) and turn_seed(7, 3) == turn_seed(7, 3)


def test_the_policy_sends_sampling_fields_but_not_rendering_ones() -> None:
    sent: list[dict[str, Any]] = []

    class Client:
        async def generate(self, model: str, prompt_ids: list[int], params: dict[str, Any]) -> Generation:
            sent.append({"model": model, "prompt": prompt_ids, **params})
            return Generation([1], [-0.1], "stop")

    sampling = {
        "temperature": 0.7,
        "top_p": 1.0,
        "max_tokens": 64,
        "seed": 11,
        "chat_template_kwargs": {"x": 1},
    }
    policy = TokenPolicy(Client(), "m", sampling)  # type: ignore[arg-type]
    asyncio.run(policy.generate([3, 4], 20, turn=2))
    assert sent == [
        {
            "model": "m",
            "prompt": [3, 4],
            "temperature": 0.7,
            "top_p": 1.0,
            "seed": turn_seed(11, 2),
            "max_tokens": 20,
            "logprobs": 0,
            "n": 1,
        }
    ]

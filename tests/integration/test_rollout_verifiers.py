"""Rollouts through verifiers v1 environments against a fake OpenAI-compatible server.

The fake server (FastAPI on 127.0.0.1, random port, in a thread) renders the chat template of
the tiny model with a character-level tokenizer, answers the sum asked in the last user message
(or a scripted wrong/broken answer, chosen by the request's ``model``), and returns vLLM's
``return_token_ids`` fields. Expected token ids and logprobs are computed here from the same
template by hand, not read back from the code under test.
"""

from __future__ import annotations

import asyncio
import re
import socket
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from prime_composer.config.env import EnvConfig, RolloutConfig, SamplingConfig
from prime_composer.orchestrator import envs
from prime_composer.orchestrator.rollout import RolloutRunner
from prime_composer.orchestrator.sample import Sample

REPO_ENV_DIR = Path(__file__).resolve().parents[2] / "environments"
SPECIAL = {"<|im_start|>": 1000, "<|im_end|>": 1001}
EOS = SPECIAL["<|im_end|>"]


def render(messages: list[dict[str, str]]) -> str:
    """The tiny model's chat template with the generation prompt."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + "<|im_start|>assistant\n"


def tokenize(text: str) -> list[int]:
    """Special tokens as 1000/1001, every other character as its code point."""
    ids, i = [], 0
    while i < len(text):
        special = next((s for s in SPECIAL if text.startswith(s, i)), None)
        if special:
            ids.append(SPECIAL[special])
            i += len(special)
        else:
            ids.append(ord(text[i]))
            i += 1
    return ids


def logprob(position: int, token: int) -> float:
    """The fake server's scripted logprob of the token at ``position`` of a completion."""
    return -0.5 * (position + 1) - 0.001 * token


class FakeServer:
    """Scripted chat completions; ``model`` picks the behaviour (see ``_answer``)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.num_in_flight = 0
        self.max_in_flight = 0
        self.app = FastAPI()
        self.app.post("/v1/chat/completions")(self._chat)

    async def _chat(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.requests.append(body)
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        try:
            if body["model"] == "slow":
                await asyncio.sleep(0.05)
            return self._answer(body)
        finally:
            self.num_in_flight -= 1

    def _answer(self, body: dict[str, Any]) -> JSONResponse:
        model, messages = body["model"], body["messages"]
        if model == "http-500":
            return JSONResponse({"error": {"message": "engine died"}}, status_code=500)
        match = re.search(r"(\d+) \+ (\d+)", messages[-1]["content"])
        answer = str(int(match.group(1)) + int(match.group(2))) if match else "?"
        if model == "alternate" and len(self.requests) % 2 == 0:
            answer = f"x{answer}"
        completion = [*tokenize(answer), EOS]
        if model == "retokenize":  # ids that the template does not reproduce next turn
            completion = [t + 500 for t in completion[:-1]] + [EOS]
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": answer},
            "finish_reason": "length" if model == "truncate" else "stop",
            "token_ids": completion,
            "logprobs": {
                "content": [
                    {"token": str(t), "logprob": logprob(j, t), "bytes": None, "top_logprobs": []}
                    for j, t in enumerate(completion)
                ]
            },
        }
        if model == "no-logprobs":
            del choice["logprobs"]
        prompt = tokenize(render(messages))
        response = {
            "id": "fake",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [choice],
            "prompt_token_ids": prompt,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(completion),
                "total_tokens": len(prompt) + len(completion),
            },
        }
        if model == "no-token-ids":
            del response["prompt_token_ids"], choice["token_ids"]
        return JSONResponse(response)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[FakeServer, str]]:
    fake = FakeServer()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(fake.app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not uv.started:
        assert time.time() < deadline, "fake server did not start"
        time.sleep(0.01)
    yield fake, f"http://127.0.0.1:{port}/v1"
    uv.should_exit = True
    thread.join(timeout=10)
    sock.close()


TWO_TURN_ENV = '''
"""A test environment: the model answers, then is asked to add one to its own answer."""

import verifiers.v1 as vf


class TwoTurnData(vf.TaskData):
    answer: str


class TwoTurnTask(vf.Task[TwoTurnData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.metric
    async def crash(self, trace: vf.Trace) -> float:
        if self.data.id == "boom":
            raise RuntimeError("scoring exploded")
        return 0.0


class TwoTurnConfig(vf.TasksetConfig):
    num_tasks: int = 2


class TwoTurnTaskset(vf.Taskset[TwoTurnTask, TwoTurnConfig]):
    def load(self):
        tasks = [TwoTurnTask(TwoTurnData(prompt=f"What is {i} + 1?", answer=str(i + 2)), self.config.task)
                 for i in range(self.config.num_tasks)]
        boom = TwoTurnData(id="boom", prompt="What is 1 + 1?", answer="3")
        return [*tasks, TwoTurnTask(boom, self.config.task)]


class TwoTurnEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class TwoTurnEnv(vf.Env[TwoTurnEnvConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            first = await chat.turn()
            await chat.turn(f"What is {first.last_reply} + 1?")


__all__ = ["TwoTurnEnv", "TwoTurnTaskset"]
'''


@pytest.fixture(scope="module")
def env_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("environments")
    package = root / "pc-two-turn" / "pc_two_turn"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(TWO_TURN_ENV))
    return [REPO_ENV_DIR, root]


def run_groups(
    loaded: envs.LoadedEnv,
    base_url: str,
    model: str,
    *,
    num_groups: int = 1,
    group_size: int = 8,
    sampling: SamplingConfig | None = None,
    rollout: RolloutConfig | None = None,
    policy_step: int = 7,
    task_offset: int = 0,
) -> list[list[Sample]]:
    async def main() -> list[list[Sample]]:
        tasks = loaded.tasks()
        async with RolloutRunner(
            [loaded], base_url=base_url, model=model, sampling=sampling, rollout=rollout
        ) as runner:
            return await asyncio.gather(
                *(
                    runner.run_group(
                        loaded,
                        tasks[task_offset + g],
                        group_size=group_size,
                        example_id=task_offset + g,
                        group_id=100 + g,
                        policy_step=policy_step,
                    )
                    for g in range(num_groups)
                )
            )

    return asyncio.run(main())


@pytest.fixture(scope="module")
def arith(env_dirs: list[Path]) -> envs.LoadedEnv:
    return envs.load_env(EnvConfig(id="arith"), 0, env_dirs=env_dirs)


def test_group_tokens_logprobs_rewards(server, arith) -> None:
    fake, base_url = server
    num_before = len(fake.requests)
    (group,) = run_groups(arith, base_url, "alternate", sampling=SamplingConfig(max_tokens=5))
    task = arith.tasks()[0]
    answer = str(task.data.a + task.data.b)
    prompt = tokenize(render([{"role": "user", "content": f"What is {task.data.a} + {task.data.b}?"}]))

    assert len(group) == 8
    assert sorted(s.reward for s in group) == [0.0] * 4 + [1.0] * 4
    for sample in group:
        assert sample.error is None
        assert (sample.example_id, sample.group_id, sample.policy_step) == (0, 100, 7)
        assert sample.prompt_ids == prompt
        reply = answer if sample.reward == 1.0 else f"x{answer}"
        expected = [*tokenize(reply), EOS]
        assert sample.completion_ids == expected
        assert sample.completion_logprobs == pytest.approx([logprob(j, t) for j, t in enumerate(expected)])
        assert sample.completion_mask == [1] * len(expected)
        assert sample.metrics["reward/correct"] == sample.reward
        assert sample.metrics["is_integer"] == float(sample.reward == 1.0)
        assert sample.episode.messages[-1] == {"role": "assistant", "content": reply}
        assert not sample.is_truncated
        if sample.reward == 0.0:  # the environment's feedback reaches the sample (SDPO hints)
            assert sample.episode.feedback["kind"] == "wrong_format"
            assert f"'x{answer}'" in sample.episode.feedback["text"]
        else:
            assert sample.episode.feedback is None

    sent = fake.requests[num_before:]
    assert len(sent) == 8
    for body in sent:
        assert body["logprobs"] is True and body["return_token_ids"] is True
        assert (body["temperature"], body["top_p"], body["max_tokens"]) == (1.0, 1.0, 5)
        assert "seed" not in body


def test_seed_only_when_asked_and_distinct_within_a_group(server, arith) -> None:
    fake, base_url = server
    num_before = len(fake.requests)
    run_groups(arith, base_url, "right", group_size=4, sampling=SamplingConfig(seed=3))
    seeds = [body["seed"] for body in fake.requests[num_before:]]
    assert len(seeds) == 4 and len(set(seeds)) == 4


@pytest.mark.parametrize(
    ("model", "message"),
    [("no-logprobs", "no logprobs"), ("no-token-ids", "no token ids"), ("http-500", "500")],
)
def test_failed_rollouts_become_error_samples(server, arith, model: str, message: str) -> None:
    _, base_url = server
    (group,) = run_groups(arith, base_url, model, group_size=3)
    assert len(group) == 3
    for sample in group:
        assert sample.error is not None and message in sample.error
        assert sample.reward == 0.0 and sample.completion_ids == []
        assert sample.policy_step == 7


def test_length_finish_marks_truncated(server, arith) -> None:
    _, base_url = server
    (group,) = run_groups(arith, base_url, "truncate", group_size=2)
    assert all(s.error is None and s.is_truncated for s in group)


def test_concurrency_is_bounded(server, arith) -> None:
    fake, base_url = server
    fake.max_in_flight = 0
    groups = run_groups(
        arith, base_url, "slow", num_groups=3, group_size=4, rollout=RolloutConfig(max_concurrent=2)
    )
    assert [len(g) for g in groups] == [4, 4, 4]
    assert all(s.error is None and s.reward == 1.0 for g in groups for s in g)
    assert fake.max_in_flight == 2


def test_multi_turn_splices_user_turn_with_mask_zero(server, env_dirs) -> None:
    _, base_url = server
    loaded = envs.load_env(EnvConfig(id="pc-two-turn"), 1, env_dirs=env_dirs)
    (group,) = run_groups(loaded, base_url, "right", group_size=2)
    user0 = {"role": "user", "content": "What is 0 + 1?"}
    first = [*tokenize("1"), EOS]
    spliced = tokenize("\n<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n")
    second = [*tokenize("2"), EOS]
    for sample in group:
        assert sample.error is None and sample.reward == 1.0
        assert sample.prompt_ids == tokenize(render([user0]))
        assert sample.completion_ids == first + spliced + second
        assert sample.completion_mask == [1] * len(first) + [0] * len(spliced) + [1] * len(second)
        expected_logprobs = (
            [logprob(j, t) for j, t in enumerate(first)]
            + [0.0] * len(spliced)
            + [logprob(j, t) for j, t in enumerate(second)]
        )
        assert sample.completion_logprobs == pytest.approx(expected_logprobs)
        assert sample.metrics["num_turns"] == 2.0


def test_multi_turn_token_mismatch_splits_the_rollout_and_env_exceptions_are_errors(server, env_dirs) -> None:
    _, base_url = server
    loaded = envs.load_env(EnvConfig(id="pc-two-turn"), 1, env_dirs=env_dirs)
    # The server's ids for the replies are not what the template renders next turn: each turn
    # starts a new sample (PRIME-RL's rule), and both carry the episode's reward.
    (mismatch,) = run_groups(loaded, base_url, "retokenize", group_size=2)
    assert len(mismatch) == 4
    user0 = {"role": "user", "content": "What is 0 + 1?"}
    later = [user0, {"role": "assistant", "content": "1"}, {"role": "user", "content": "What is 1 + 1?"}]
    for first, second in zip(mismatch[::2], mismatch[1::2], strict=True):
        assert first.error is None and second.error is None
        assert first.episode.trace_id == second.episode.trace_id
        assert first.prompt_ids == tokenize(render([user0]))
        assert first.completion_ids == [t + 500 for t in tokenize("1")] + [EOS]
        assert second.prompt_ids == tokenize(render(later))
        assert second.completion_ids == [t + 500 for t in tokenize("2")] + [EOS]
        assert second.completion_mask == [1] * len(second.completion_ids)
        assert first.reward == second.reward == 1.0
        assert [t.index for t in first.episode.turns] == [0] and [t.index for t in second.episode.turns] == [
            1
        ]
    (boom,) = run_groups(loaded, base_url, "right", group_size=2, task_offset=2)
    assert all(s.error is not None and "scoring exploded" in s.error and s.reward == 0.0 for s in boom)

"""The guess game of ``tests/integration/openenv_envs.py`` as a taskset of our own (no OpenEnv),
and a scripted token-in policy that plays it, for ``bench/openenv_episodes.py``.

``guess_local`` (this module, imported by name from ``bench/``) is an agentic taskset whose
``setup`` puts an in-process ``LocalGuess`` on the episode's state as its external environment: the
same rules, prompts and rewards as the OpenEnv server's game, so the two differ only in OpenEnv's
server, WebSocket session and client.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import verifiers.v1 as vf
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from prime_composer.inference.local import running_app
from prime_composer.orchestrator.agent_task import AgentState, AgentTaskData

MAX_GUESSES = 3
ASSISTANT = "<|im_start|>assistant"


class LocalGuess:
    """An ``ExternalEnvironment``: guess ``"abc"[seed % 3]`` in at most 3 tries."""

    def __init__(self, seed: int) -> None:
        self.target = "abc"[seed % 3]
        self.steps = 0
        self.total_reward = 0.0
        self._done = False

    @property
    def opening(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "Guess a letter: a, b or c."}]

    @property
    def tools(self) -> None:
        return None

    @property
    def done(self) -> bool:
        return self._done

    async def act(self, text: str) -> str | None:
        self.steps += 1
        right = text.strip() == self.target
        self.total_reward += float(right)
        self._done = right or self.steps >= MAX_GUESSES
        return "right" if right else "wrong"


class GuessData(AgentTaskData):
    seed: int = 0


class GuessTask(vf.Task[GuessData, AgentState]):
    async def setup(self, trace: vf.Trace, runtime: vf.Runtime) -> None:
        assert isinstance(trace.state, AgentState)
        trace.state.environment = LocalGuess(self.data.seed)

    @vf.reward(weight=1.0)
    async def guessed(self, trace: vf.Trace) -> float:
        environment = getattr(trace.state, "environment", None)
        return environment.total_reward if environment is not None else 0.0


class GuessConfig(vf.TasksetConfig):
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2])


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self) -> list[GuessTask]:
        return [
            GuessTask(
                GuessData(name=f"guess#{s}", id=f"guess#{s}", prompt="guess", tools=[], seed=s),
                self.config.task,
            )
            for s in self.config.seeds
        ]


__all__ = ["GuessTaskset"]


class GuessPolicy:
    """``POST /inference/v1/generate`` that guesses a, b, c in turn (by the assistant turns in the
    prompt); a decode and an encode per call."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.num_calls = 0
        self.app = FastAPI()
        self.app.post("/inference/v1/generate")(self._generate)
        self.app.get("/v1/models")(
            lambda: {"object": "list", "data": [{"id": "guess", "max_model_len": 4096}]}
        )
        self.app.get("/health")(lambda: {"status": "ok"})

    async def _generate(self, request: Request) -> JSONResponse:
        body = await request.json()
        prompt = list(body["token_ids"])
        text = self.tokenizer.decode(prompt, skip_special_tokens=False)
        reply = "abc"[(text.count(ASSISTANT) - 1) % 3]
        ids = [*self.tokenizer.encode(reply, add_special_tokens=False), self.tokenizer.eos_token_id]
        self.num_calls += 1
        content = [{"token": f"token_id:{t}", "logprob": -0.5, "top_logprobs": []} for t in ids]
        choice = {"index": 0, "token_ids": ids, "logprobs": {"content": content}, "finish_reason": "stop"}
        return JSONResponse({"request_id": "r", "choices": [choice], "prompt_token_ids": prompt})

    @contextlib.contextmanager
    def serve(self) -> Iterator[str]:
        """Serve on a free port of 127.0.0.1 in a thread; yields the OpenAI base URL."""
        with running_app(self.app, startup_timeout_s=30) as url:
            yield f"{url}/v1"

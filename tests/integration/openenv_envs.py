"""Small OpenEnv environments written with openenv's own server API, for the OpenEnv adapter's tests.

- ``guess_app``: guess a letter of "abc" (the target is ``"abc"[seed % 3]``); reward 1 for the
  right letter, 0 otherwise; the episode ends at the right guess or after 3 guesses. Actions are
  ``GuessAction(guess: str)``, observations ``GuessObservation(feedback: str)``.
- ``counter_app``: an ``MCPEnvironment`` with one tool, ``add(n: int)``, that adds to a counter;
  each call is rewarded 1 when the counter then equals ``goal`` (a reset argument, default 5),
  and the episode ends once the counter reaches it.
- ``brevity_app``: any text is an action (``SayAction(message: str)``); each step is rewarded
  ``1 / (1 + len(message.strip()))`` and the episode ends after 2 steps (rewards that vary with
  what a random policy writes, for the launcher test).

Serve one with ``python -m uvicorn openenv_envs:guess_app`` from this folder.
"""

from __future__ import annotations

from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server import (
    Action,
    CallToolAction,
    CallToolObservation,
    Environment,
    MCPEnvironment,
    Observation,
    State,
    create_app,
)

MAX_GUESSES = 3


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    feedback: str


class GuessEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State()
        self.target = "a"

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> GuessObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self.target = "abc"[(seed or 0) % 3]
        return GuessObservation(feedback="Guess a letter: a, b or c.")

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        assert isinstance(action, GuessAction)
        self._state.step_count += 1
        right = action.guess.strip() == self.target
        done = right or self._state.step_count >= MAX_GUESSES
        return GuessObservation(feedback="right" if right else "wrong", reward=float(right), done=done)

    @property
    def state(self) -> State:
        return self._state


class CounterEnv(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("counter")
        self.total = 0
        self.goal = 5

        @mcp.tool
        def add(n: int) -> int:
            """Add n to the counter; returns the new total."""
            self.total += n
            return self.total

        super().__init__(mcp)
        self._state = State()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        self.total, self.goal = 0, int(kwargs.get("goal", 5))
        self._state = State(episode_id=episode_id)
        return Observation(metadata={"task": f"Make the counter reach {self.goal} with the add tool."})

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(metadata={"error": f"unknown action {type(action).__name__}"})

    def _score(self, observation: Observation) -> Observation:
        self._state.step_count += 1
        if isinstance(observation, CallToolObservation) and observation.error is None:
            observation.reward = float(self.total == self.goal)
            observation.done = self.total >= self.goal
        return observation

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._score(super().step(action, timeout_s=timeout_s, **kwargs))

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._score(await super().step_async(action, timeout_s=timeout_s, **kwargs))

    @property
    def state(self) -> State:
        return self._state


class SayAction(Action):
    message: str


class SayObservation(Observation):
    heard: str


class BrevityEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True
    NUM_STEPS = 2

    def __init__(self) -> None:
        super().__init__()
        self._state = State()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> SayObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        return SayObservation(heard="Say something short.")

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> SayObservation:
        assert isinstance(action, SayAction)
        self._state.step_count += 1
        text = action.message.strip()
        return SayObservation(
            heard=text[:20],
            reward=1.0 / (1 + len(text)),
            done=self._state.step_count >= self.NUM_STEPS,
        )

    @property
    def state(self) -> State:
        return self._state


guess_app = create_app(GuessEnv, GuessAction, GuessObservation, max_concurrent_envs=64)
counter_app = create_app(CounterEnv, CallToolAction, CallToolObservation, max_concurrent_envs=64)
brevity_app = create_app(BrevityEnv, SayAction, SayObservation, max_concurrent_envs=64)

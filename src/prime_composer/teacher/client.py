"""The teacher service as the orchestrator sees it: the one module of this package other processes
import. Traces go in over HTTP (``POST /v1/traces``); pairs and process rewards come out of the
service's store, read through ``pairs.PairStore`` (whose queries are built from the store's own
``pairs`` table and ``Pair``'s fields). The channel is ``replay`` everywhere (config sections
``orchestrator.replay`` / ``trainer.loss.replay``, batch group, metrics ``replay/...``).

    client = TeacherClient(store_path)
    client.connect(url, api_key, retry)        # only to send traces
    client.send(traces)                        # in the background; failures are counted
    pairs = client.take_pairs(16, after_cursor=cursor)
    newest = client.newest_cursor()            # ready pairs are cursors 1..newest
    reward = client.process_reward(trace)      # mean over the trace's labeled steps, or None
    steps = client.step_process_rewards(trace) # one per step (assistant turn), None: unlabeled

Traces are dicts in ``traces.py``'s schema (``orchestrator/trace_export.py`` writes them). A failed
or refused batch is counted (``replay/traces_failed``), never a crash.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from prime_composer.client.http import EndpointClient
from prime_composer.config.client import RetryConfig
from prime_composer.config.teacher import TraceSourceConfig
from prime_composer.teacher.actions import turn_action
from prime_composer.teacher.pairs import Pair, PairStore
from prime_composer.teacher.traces import TraceError, parse_trace
from prime_composer.teacher.votes import process_reward

__all__ = ["Pair", "TeacherClient"]

logger = logging.getLogger(__name__)

_LIMITS = TraceSourceConfig(max_line_bytes=2**62, max_turns=2**31, max_turn_chars=2**62)
"""Rollouts are the run's own: no import limits."""


class TeacherClient:
    """Traces to the teacher service, pairs and process rewards from its store."""

    def __init__(self, store: Path) -> None:
        self.store = PairStore(store)
        self.http: EndpointClient | None = None
        self.num_sent = 0
        self.num_failed = 0
        self._tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------------------ traces in

    def connect(self, teacher_url: str, api_key: str | None, retry: RetryConfig) -> None:
        """Send traces to the service at ``teacher_url`` from now on (``orchestrator.replay.retry``)."""
        self.http = EndpointClient(teacher_url, retry=retry, api_key=api_key)

    @property
    def connected(self) -> bool:
        return self.http is not None

    def send(self, traces: list[dict[str, Any]]) -> None:
        """Post traces to the service in the background (needs a running event loop)."""
        if self.http is None:
            raise RuntimeError("TeacherClient.send needs connect(teacher_url, ...) first")
        if traces:
            task = asyncio.create_task(self._post(traces))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _post(self, traces: list[dict[str, Any]]) -> None:
        assert self.http is not None
        result = await self.http.post_json("/v1/traces", {"traces": traces})
        if result.ok:
            self.num_sent += len(result.data.get("accepted", []))
            self.num_failed += len(result.data.get("rejected", []))
        else:
            self.num_failed += len(traces)
            logger.warning("teacher service refused %d traces: %s", len(traces), result.error)

    def metrics(self) -> dict[str, float]:
        return {"replay/traces_sent": self.num_sent, "replay/traces_failed": self.num_failed}

    # ------------------------------------------------------------------ pairs and rewards out

    def take_pairs(self, n: int, after_cursor: int = 0) -> list[Pair]:
        """Up to ``n`` ready pairs with ``cursor > after_cursor``, in cursor order."""
        return self.store.take(n, after_cursor=after_cursor)

    def newest_cursor(self) -> int:
        """The cursor of the newest ready pair (0 when none is ready)."""
        return self.store.newest_cursor()

    def process_reward(self, trace: dict[str, Any]) -> float | None:
        """The mean process reward of the rollout's own actions at the trace's labeled steps (the
        teachers' votes at each step's state: ``votes.process_reward``), None with no labeled step
        or when the rollout is no valid trace."""
        rewards = [r for r in self.step_process_rewards(trace) or [] if r is not None]
        return sum(rewards) / len(rewards) if rewards else None

    def step_process_rewards(self, trace: dict[str, Any]) -> list[float | None] | None:
        """The process reward of the rollout's own action at each of the trace's steps (assistant
        turns, in order), None at a step whose state no teacher labeled; None when the rollout is
        no valid trace."""
        try:
            parsed = parse_trace(trace, "rollout", _LIMITS)
        except TraceError as e:  # a rollout that is no valid trace is simply not shaped
            logger.debug("rollout not looked up: %s", e)
            return None
        rewards: list[float | None] = []
        for k in parsed.step_indices:
            votes = self.store.votes_at(parsed.state_hash(k))
            rewards.append(process_reward(turn_action(parsed.turns[k]).key, votes) if votes else None)
        return rewards

    async def aclose(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.http is not None:
            await self.http.aclose()
        self.store.close()

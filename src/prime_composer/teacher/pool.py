"""The teacher pool: one ``EndpointClient`` per teacher, behind the response cache, the budget and
the ledger.

``TeacherPool.ask`` is the only way the service calls a teacher:

1. the cache key is ``sha256(teacher, model, prompt hash, sampling settings)``; a cached answer is
   returned at no cost (ledger outcome ``cache_hit``), and concurrent asks of the same key share
   one call;
2. the call's worst-case cost is reserved against the trace and run budgets (``budget.py``); when
   it does not fit, nothing is sent (ledger outcome ``budget``);
3. the call goes through ``EndpointClient`` (bounded retries with backoff on 429/5xx/timeouts);
   a failure is a ledger row with its error kind, never an exception;
4. the answer's action is parsed (``actions.parse_answer``); an answer without one is recorded
   as ``malformed`` and cached like any paid answer (asking again would pay for the same reply).

Dollars come from the endpoint's reported ``usage`` at the configured prices; an answer without
``usage`` is charged its worst case, so the budget stays an upper bound.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from prime_composer.client.http import EndpointClient, read_api_key
from prime_composer.config.teacher import BudgetConfig, OnPolicyConfig, TeacherEndpointConfig
from prime_composer.teacher.actions import (
    Action,
    ParseError,
    action_from_json,
    action_to_json,
    parse_agent_reply,
    parse_answer,
)
from prime_composer.teacher.budget import Budget, call_cost, prompt_token_bound, worst_case_cost
from prime_composer.teacher.prompts import prompt_hash
from prime_composer.teacher.store import LedgerRow, TeacherStore

logger = logging.getLogger(__name__)

BYTES_PER_TOKEN = 4.0
"""Typical UTF-8 bytes per token of English text and code, for *expected* costs (the gate's
ranking); budgets use the worst case instead."""


@dataclass(frozen=True)
class Answer:
    """What asking one teacher at one step gave."""

    teacher: str
    action: Action | None
    outcome: str
    """``ok`` | ``malformed`` | ``cache_hit`` | ``budget`` | an ``EndpointClient`` error kind."""
    dollars: float
    error: str | None = None


def _sampling(endpoint: TeacherEndpointConfig) -> dict[str, Any]:
    return {"temperature": endpoint.temperature, "max_tokens": endpoint.max_tokens, **endpoint.extra_body}


def cache_key(endpoint: TeacherEndpointConfig, messages: list[dict[str, str]]) -> str:
    blob = json.dumps(
        [endpoint.id, endpoint.model, prompt_hash(messages), _sampling(endpoint)],
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(blob.encode()).hexdigest()


class TeacherPool:
    """The configured teachers, in config order (``cascade_order`` sorts them by expected cost)."""

    def __init__(
        self,
        endpoints: list[TeacherEndpointConfig],
        budget_cfg: BudgetConfig,
        store: TeacherStore,
        budget: Budget,
        *,
        expected_output_tokens: int = 96,
    ) -> None:
        self.endpoints = list(endpoints)
        self.budget_cfg = budget_cfg
        self.store = store
        self.budget = budget
        self.expected_output_tokens = expected_output_tokens
        for i, e in enumerate(self.endpoints):
            if e.base_url is None:
                raise ValueError(
                    f"teacher.pool[{i}] ({e.id!r}) has no base_url: a `local` teacher is started by `rl`, "
                    "which fills it in; to run the service alone, serve the teacher and set its base_url"
                )
        self._clients = {
            e.id: EndpointClient(
                e.base_url or "",
                retry=e.retry,
                api_key=read_api_key(e.api_key_env, f"teacher.pool[{i}].api_key_env"),
                max_concurrency=e.max_concurrency,
            )
            for i, e in enumerate(self.endpoints)
        }
        self._in_flight: dict[str, asyncio.Future[Answer]] = {}

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()

    # ----------------------------------------------------------------------------------- costs

    def expected_cost(self, endpoint: TeacherEndpointConfig, messages: list[dict[str, str]]) -> float:
        """Dollars a call is expected to cost (typical bytes per token, typical answer length)."""
        text_bytes = sum(len(m["content"].encode()) for m in messages)
        tokens_in = int(text_bytes / BYTES_PER_TOKEN) + self.budget_cfg.prompt_overhead_tokens
        return call_cost(endpoint, tokens_in, self.expected_output_tokens)

    def cascade_order(self, messages: list[dict[str, str]]) -> list[TeacherEndpointConfig]:
        """Teachers from cheapest to dearest for this prompt (config order among equals)."""
        return sorted(self.endpoints, key=lambda e: self.expected_cost(e, messages))

    def smallest_worst_case(self, messages: list[dict[str, str]]) -> float:
        return min(
            worst_case_cost(e, messages, self.budget_cfg.prompt_overhead_tokens) for e in self.endpoints
        )

    # ------------------------------------------------------------------------------------ asks

    async def ask(
        self, endpoint: TeacherEndpointConfig, messages: list[dict[str, str]], trace_id: str, turn_index: int
    ) -> Answer:
        """Ask ``endpoint`` for the next action at this state (see the module docstring)."""
        key = cache_key(endpoint, messages)
        shared = self._in_flight.get(key)
        if shared is not None:  # the same question is being asked right now: wait for its answer
            answer = await asyncio.shield(shared)
            if answer.outcome in ("ok", "malformed"):
                return await self._from_cache(endpoint, key, trace_id, turn_index) or answer
            return answer
        cached = await self._from_cache(endpoint, key, trace_id, turn_index)
        if cached is not None:
            return cached
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._in_flight[key] = future
        try:
            answer = await self._call(endpoint, key, messages, trace_id, turn_index)
            future.set_result(answer)
            return answer
        except BaseException as e:
            future.set_exception(e)
            future.exception()  # mark retrieved: waiters see it, an unwaited future logs nothing
            raise
        finally:
            del self._in_flight[key]

    async def _from_cache(
        self, endpoint: TeacherEndpointConfig, key: str, trace_id: str, turn_index: int
    ) -> Answer | None:
        hit = self.store.cached(key)
        if hit is None:
            return None
        self.store.record_call(
            LedgerRow(trace_id, turn_index, endpoint.id, endpoint.model, key, 0, 0, 0.0, 0.0, 0, "cache_hit")
        )
        action = action_from_json(hit.action) if hit.action is not None else None
        return Answer(endpoint.id, action, "cache_hit", 0.0, hit.parse_error)

    async def _call(
        self,
        endpoint: TeacherEndpointConfig,
        key: str,
        messages: list[dict[str, str]],
        trace_id: str,
        turn_index: int,
    ) -> Answer:
        overhead = self.budget_cfg.prompt_overhead_tokens
        worst = worst_case_cost(endpoint, messages, overhead)
        reservation = self.budget.reserve(trace_id, worst)
        if reservation is None:
            self.store.record_call(
                LedgerRow(
                    trace_id, turn_index, endpoint.id, endpoint.model, key, 0, 0, 0.0, 0.0, 0, "budget",
                    f"worst case ${worst:.6f} does not fit the remaining budget",
                )
            )  # fmt: skip
            return Answer(endpoint.id, None, "budget", 0.0, "budget")
        dollars = 0.0
        try:
            body = {"model": endpoint.model, "messages": messages, **_sampling(endpoint)}
            result = await self._clients[endpoint.id].chat_completion(body)
            tokens_in, tokens_out, estimated = _usage(
                result.data, prompt_token_bound(messages, overhead), endpoint.max_tokens
            )
            if not result.ok:
                # An error answer is not billed unless the endpoint says it used tokens.
                dollars = call_cost(endpoint, tokens_in, tokens_out) if not estimated else 0.0
                self.store.record_call(
                    LedgerRow(
                        trace_id, turn_index, endpoint.id, endpoint.model, key,
                        tokens_in if not estimated else 0, tokens_out if not estimated else 0, dollars,
                        result.latency_s, result.attempts, result.error_kind or "error", result.error,
                    )
                )  # fmt: skip
                return Answer(endpoint.id, None, result.error_kind or "error", dollars, result.error)
            dollars = call_cost(endpoint, tokens_in, tokens_out)
            message = result.data["choices"][0]["message"]
            kept = {k: message.get(k) for k in ("content", "tool_calls") if message.get(k) is not None}
            action: Action | None
            parse = parse_agent_reply if endpoint.protocol == "agent" else parse_answer
            try:
                action, outcome, error = parse(message), "ok", None
            except ParseError as e:
                action, outcome, error = None, "malformed", str(e)
            if estimated:
                error = (error + "; " if error else "") + "no usage in the answer: charged the worst case"
            self.store.record_call(
                LedgerRow(
                    trace_id, turn_index, endpoint.id, endpoint.model, key, tokens_in, tokens_out, dollars,
                    result.latency_s, result.attempts, outcome, error,
                ),
                cache={
                    "prompt_hash": prompt_hash(messages),
                    "sampling": json.dumps(_sampling(endpoint), sort_keys=True),
                    "message": kept,
                    "action": action_to_json(action) if action is not None else None,
                    "parse_error": error if action is None else None,
                },
            )  # fmt: skip
            return Answer(endpoint.id, action, outcome, dollars, error)
        finally:
            self.budget.settle(reservation, dollars)


def _usage(data: Any, bound_in: int, bound_out: int) -> tuple[int, int, bool]:
    """``(prompt tokens, completion tokens, estimated)`` from an answer's ``usage``; the worst case,
    flagged as estimated, when the answer has none."""
    try:
        usage = data["usage"]
        return int(usage["prompt_tokens"]), int(usage.get("completion_tokens") or 0), False
    except (KeyError, TypeError, ValueError):
        return bound_in, bound_out, True


@dataclass(frozen=True)
class StudentSample:
    action: Action | None
    text: str
    token_ids: list[int] | None


class StudentSampler:
    """Samples the student at a state (the on-policy chosen side), through ``EndpointClient``."""

    def __init__(self, cfg: OnPolicyConfig, seed: int) -> None:
        assert cfg.base_url is not None and cfg.model is not None  # enforced by OnPolicyConfig
        self.cfg = cfg
        self.seed = seed
        self._client = EndpointClient(
            cfg.base_url,
            retry=cfg.retry,
            api_key=read_api_key(cfg.api_key_env, "teacher.pairs.on_policy.api_key_env"),
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def sample(self, messages: list[dict[str, str]], salt: str) -> list[StudentSample]:
        """``num_samples`` samples at the state; [] when the call fails (logged: no on-policy side)."""
        body = {
            "model": self.cfg.model,
            "messages": messages,
            "n": self.cfg.num_samples,
            "temperature": self.cfg.temperature,
            "max_tokens": self.cfg.max_tokens,
            "seed": (self.seed * 1_000_003 + int(salt[:8], 16)) % (2**31),
            "return_token_ids": True,
        }
        result = await self._client.chat_completion(body)
        if not result.ok:
            logger.warning("student samples failed: %s", result.error)
            return []
        samples = []
        for choice in result.data.get("choices", []):
            message = choice.get("message") or {}
            try:
                action: Action | None = parse_answer(message)
            except ParseError:
                action = None
            ids = choice.get("token_ids")
            samples.append(
                StudentSample(action, str(message.get("content") or ""), list(ids) if ids else None)
            )
        return samples

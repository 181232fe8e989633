"""The teacher pool: one ``TeacherCaller`` per teacher, behind the response cache, the budget and
the ledger.

``TeacherPool.ask`` is the only way the service calls a teacher:

1. the cache key is ``sha256(teacher, model, prompt hash, sampling settings)``; a cached answer is
   returned at no cost (ledger outcome ``cache_hit``), and concurrent asks of the same key share
   one call;
2. before each attempt, its worst-case cost is reserved against the trace and run budgets
   (``budget.py``) and written to the store (``reservations``), so a crash cannot lose what the
   provider may bill; when it does not fit, nothing is sent and the answer is ``budget``, with its
   ledger row in ``Answer.refusal`` for the caller to record once the step gives up waiting;
3. each attempt is bounded (``calls.py``: wall-clock per attempt and per step, reply bytes and
   tokens), with bounded retries and backoff on 429/5xx/timeouts/connection errors; the call's
   ledger row (one per call, every attempt's cost summed) is written in the transaction that drops
   its reservation; a failure is a ledger row with its error kind, never an exception;
4. the answer's action is parsed (``actions.parse_answer``); an answer without one is recorded
   as ``malformed`` and cached like any paid answer (asking again would pay for the same reply).

Dollars come from the endpoint's reported ``usage`` at the configured prices. An attempt without
``usage`` the provider may still have billed (timed out after the request was sent, cut off as too
large, not JSON) is charged its reserved worst case, so the ledger stays an upper bound; an HTTP
error status without usage costs nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, cast

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
from prime_composer.teacher.budget import Budget, call_cost, prompt_token_bound
from prime_composer.teacher.calls import Attempt, TeacherCaller
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
    """``ok`` | ``malformed`` | ``cache_hit`` | ``budget`` | a ``calls.Attempt`` error kind."""
    dollars: float
    error: str | None = None
    refusal: LedgerRow | None = None
    """For ``budget``: the ledger row of the refusal (``TeacherPool.record_refusals``)."""


LIMIT_OUTCOMES = ("timeout", "step_deadline", "too_large", "too_many_tokens")
"""Ledger outcomes of calls cut off by a bound (counted in the metrics by kind)."""


def _sampling(endpoint: TeacherEndpointConfig) -> dict[str, Any]:
    return {"temperature": endpoint.temperature, "max_tokens": endpoint.max_tokens, **endpoint.extra_body}


Prompt = list[dict[str, Any]] | list[int]
"""Chat messages, or the student's context as token ids (``send_token_ids``: ``/completions``)."""


def cache_key(endpoint: TeacherEndpointConfig, prompt: Prompt) -> str:
    blob = json.dumps(
        [endpoint.id, endpoint.model, prompt_hash(prompt), _sampling(endpoint)],
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
        self._callers = {
            e.id: TeacherCaller(
                e.base_url or "",
                api_key=read_api_key(e.api_key_env, f"teacher.pool[{i}].api_key_env"),
                max_concurrency=e.max_concurrency,
                max_reply_bytes=e.max_reply_bytes,
            )
            for i, e in enumerate(self.endpoints)
        }
        self._in_flight: dict[str, asyncio.Future[Answer]] = {}

    async def aclose(self) -> None:
        for caller in self._callers.values():
            await caller.aclose()

    # ----------------------------------------------------------------------------------- costs

    def expected_cost(self, endpoint: TeacherEndpointConfig, messages: list[dict[str, str]]) -> float:
        """Dollars a call is expected to cost (typical bytes per token, typical answer length)."""
        text_bytes = sum(len(m["content"].encode()) for m in messages)
        tokens_in = int(text_bytes / BYTES_PER_TOKEN) + self.budget_cfg.prompt_overhead_tokens
        return call_cost(endpoint, tokens_in, self.expected_output_tokens)

    def cascade_order(self, messages: list[dict[str, str]]) -> list[TeacherEndpointConfig]:
        """Teachers from cheapest to dearest for this prompt (config order among equals)."""
        return sorted(self.endpoints, key=lambda e: self.expected_cost(e, messages))

    # ------------------------------------------------------------------------------------ asks

    def record_refusals(self, answers: list[Answer]) -> None:
        """Write the ledger rows of the ``budget`` answers among ``answers`` (a step that gave up)."""
        for a in answers:
            if a.refusal is not None:
                self.store.record_call(a.refusal)

    async def ask(
        self,
        endpoint: TeacherEndpointConfig,
        messages: list[dict[str, Any]],
        trace_id: str,
        turn_index: int,
        deadline: float | None = None,
        *,
        token_ids: list[int] | None = None,
    ) -> Answer:
        """Ask ``endpoint`` for the next action at this state (see the module docstring);
        ``deadline`` (``time.monotonic``) bounds the whole call, retries included. With
        ``token_ids`` (an agent teacher's ``send_token_ids``) those are sent to ``/completions``
        instead of ``messages``."""
        if deadline is None:
            deadline = time.monotonic() + 1e9
        prompt: Prompt = token_ids if token_ids is not None else messages
        key = cache_key(endpoint, prompt)
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
            answer = await self._call(endpoint, key, prompt, trace_id, turn_index, deadline)
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
        prompt: Prompt,
        trace_id: str,
        turn_index: int,
        deadline: float,
    ) -> Answer:
        caller = self._callers[endpoint.id]
        tokens = _is_token_ids(prompt)
        if tokens:  # exactly what the provider counts
            bound_in = len(prompt)
        else:
            bound_in = prompt_token_bound(
                cast(list[dict[str, Any]], prompt), self.budget_cfg.prompt_overhead_tokens
            )
        started = time.monotonic()
        dollars = 0.0  # the finished attempts' cost
        reservation_id: int | None = None
        attempt: Attempt | None = None
        number = 0
        async with caller.slot():  # waiting for a slot holds no money
            while True:
                number += 1
                reservation = self.budget.reserve_call(trace_id, endpoint, bound_in)
                if reservation is None:
                    if attempt is not None:  # a retry the budget no longer covers: the call ends here
                        break
                    refusal = LedgerRow(
                        trace_id, turn_index, endpoint.id, endpoint.model, key, 0, 0, 0.0, 0.0, 0, "budget",
                        f"a reply of {self.budget.reply_bound(endpoint)} tokens does not fit the remaining budget",
                    )  # fmt: skip
                    return Answer(endpoint.id, None, "budget", 0.0, "budget", refusal)
                max_tokens = reservation.max_tokens or endpoint.max_tokens
                try:
                    reservation_id = self.store.reserve_call(
                        reservation_id,
                        LedgerRow(
                            trace_id, turn_index, endpoint.id, endpoint.model, key, 0, 0,
                            dollars + reservation.amount, 0.0, number, "reserved",
                        ),
                    )  # fmt: skip
                    body = {
                        "model": endpoint.model,
                        "prompt" if tokens else "messages": prompt,
                        **_sampling(endpoint),
                    }
                    body["max_tokens"], body["stream"] = max_tokens, False
                    attempt = await caller.attempt(
                        body, endpoint.retry.timeout_s, deadline, completion=tokens
                    )
                except BaseException:  # cancelled: the durable reservation stays, charged in full
                    self.budget.settle(reservation, reservation.amount)
                    raise
                tokens_in, tokens_out, estimated = _usage(attempt.data, bound_in, max_tokens)
                if not estimated:
                    cost = call_cost(endpoint, tokens_in, tokens_out)
                else:  # no usage: the worst case if the provider may have billed it
                    cost = reservation.amount if attempt.billable else 0.0
                self.budget.settle(reservation, cost)
                dollars += cost
                if attempt.ok:
                    return self._answered(
                        endpoint, key, prompt, trace_id, turn_index, attempt, number, started, dollars,
                        tokens_in, tokens_out, estimated, max_tokens, reservation_id,
                    )  # fmt: skip
                retry = endpoint.retry
                if not attempt.retryable or number > retry.max_retries:
                    break
                wait = caller.backoff(number, attempt.retry_after, retry.backoff_s, retry.max_backoff_s)
                if time.monotonic() + wait >= deadline:
                    break
                await asyncio.sleep(wait)
        assert attempt is not None and attempt.kind is not None
        error = f"{attempt.kind}: {attempt.message}"
        self.store.record_call(
            LedgerRow(
                trace_id, turn_index, endpoint.id, endpoint.model, key,
                tokens_in if not estimated else 0, tokens_out if not estimated else 0, dollars,
                time.monotonic() - started, number, attempt.kind, error,
            ),
            reservation_id=reservation_id,
        )  # fmt: skip
        return Answer(endpoint.id, None, attempt.kind, dollars, error)

    def _answered(
        self,
        endpoint: TeacherEndpointConfig,
        key: str,
        prompt: Prompt,
        trace_id: str,
        turn_index: int,
        attempt: Attempt,
        number: int,
        started: float,
        dollars: float,
        tokens_in: int,
        tokens_out: int,
        estimated: bool,
        max_tokens: int,
        reservation_id: int | None,
    ) -> Answer:
        if not estimated:
            self.budget.observe_reply(endpoint.id, tokens_out)
        choice = attempt.data["choices"][0]
        message = {"content": choice["text"]} if _is_token_ids(prompt) else choice["message"]
        kept = {k: message.get(k) for k in ("content", "tool_calls") if message.get(k) is not None}
        action: Action | None
        parse = parse_agent_reply if endpoint.protocol == "agent" else parse_answer
        try:
            action, outcome, error = parse(message), "ok", None
        except ParseError as e:
            action, outcome, error = None, "malformed", str(e)
        if estimated:
            error = (error + "; " if error else "") + "no usage in the answer: charged the worst case"
        # An answer cut short by a max_tokens lowered for the budget is not the answer at the
        # configured sampling settings: paid and used, but not cached.
        cut = max_tokens < endpoint.max_tokens and choice.get("finish_reason") == "length"
        self.store.record_call(
            LedgerRow(
                trace_id, turn_index, endpoint.id, endpoint.model, key, tokens_in, tokens_out, dollars,
                time.monotonic() - started, number, outcome, error,
            ),
            cache=None if cut else {
                "prompt_hash": prompt_hash(prompt),
                "sampling": json.dumps(_sampling(endpoint), sort_keys=True),
                "message": kept,
                "action": action_to_json(action) if action is not None else None,
                "parse_error": error if action is None else None,
            },
            reservation_id=reservation_id,
        )  # fmt: skip
        return Answer(endpoint.id, action, outcome, dollars, error)


def _is_token_ids(prompt: Prompt) -> bool:
    return bool(prompt) and isinstance(prompt[0], int)


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

    async def sample(
        self, messages: list[dict[str, Any]], salt: str, token_ids: list[int] | None = None
    ) -> list[StudentSample]:
        """``num_samples`` samples at the state (from its exact context ``token_ids`` on
        ``/completions`` when given); [] when the call fails (logged: no on-policy side)."""
        body = {
            "model": self.cfg.model,
            "n": self.cfg.num_samples,
            "temperature": self.cfg.temperature,
            "max_tokens": self.cfg.max_tokens,
            "seed": (self.seed * 1_000_003 + int(salt[:8], 16)) % (2**31),
            "return_token_ids": True,
        }
        if token_ids is None:
            result = await self._client.chat_completion({**body, "messages": messages})
        else:
            result = await self._client.post_json(
                "/completions", {**body, "prompt": token_ids, "stream": False}
            )
        if not result.ok:
            logger.warning("student samples failed: %s", result.error)
            return []
        samples = []
        for choice in result.data.get("choices", []):
            message = choice.get("message") or ({"content": choice["text"]} if "text" in choice else {})
            try:  # a student sample is a turn of the agent: read as the student's own turns are
                action: Action | None = parse_agent_reply(message)
            except ParseError:
                action = None
            ids = choice.get("token_ids")
            samples.append(
                StudentSample(action, str(message.get("content") or ""), list(ids) if ids else None)
            )
        return samples

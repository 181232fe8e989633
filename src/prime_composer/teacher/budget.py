"""Hard spend caps that hold under concurrency and across crashes: reserve, then settle.

Before each attempt at a teacher, ``Budget.reserve_call`` checks ``spent + reserved + worst_case <=
cap`` for the trace and for the run and, if it fits, adds ``worst_case`` to ``reserved`` in the same
critical section; after the attempt, ``settle`` moves the reservation to ``spent`` at the real cost
(which is at most the worst case). So any number of concurrent calls can only ever commit what the
caps allow, and a cap is never exceeded even if every call in flight costs its worst case.

The worst case of a request is its prompt's upper bound in tokens (UTF-8 bytes of the messages plus
``prompt_overhead_tokens`` for the chat template: a byte-level BPE spends at most one token per
byte) times the input price, plus the ``max_tokens`` it is sent with times the output price: the
provider cannot bill more. While the full ``max_tokens`` fits, that is what is reserved and sent.
When it no longer fits, the request is sent with ``max_tokens`` lowered to what the money left
covers, provided that is at least the teacher's realistic reply bound (``reply_margin`` x the
``reply_quantile`` of its observed completion tokens, ``max_tokens`` until ``reply_samples`` are
seen); otherwise the call waits (``wait_for_release``) until a call in flight settles. So near the
end of a budget reservations are realistic, the cap still holds in provider dollars, and what is
left unspent is about one realistic call.

Every reservation is also written to the store before its request is sent (``TeacherPool``), and
removed in the transaction that records its cost; one left by a process that died is charged at
its worst case at the next start (``TeacherStore.settle_orphans``), so spending rebuilt from the
ledger never undercounts what a provider may have billed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any

from prime_composer.config.teacher import BudgetConfig, TeacherEndpointConfig

REPLY_WINDOW = 1000
"""Most recent replies per teacher the realistic bound is computed from."""

logger = logging.getLogger(__name__)

MILLION = 1_000_000


def call_cost(endpoint: TeacherEndpointConfig, input_tokens: int, output_tokens: int) -> float:
    """Dollars of one call at ``endpoint``'s prices."""
    return (input_tokens * endpoint.input_usd_per_m + output_tokens * endpoint.output_usd_per_m) / MILLION


def prompt_token_bound(messages: list[dict[str, Any]], overhead: int) -> int:
    """Upper bound on the prompt tokens of ``messages`` for a byte-level tokenizer (a message's
    other fields, ``tool_calls`` and ``tool_call_id``, count as their JSON)."""
    return overhead + sum(_message_bytes(m) + 8 for m in messages)


def _message_bytes(message: dict[str, Any]) -> int:
    size = len(message["role"].encode()) + len((message.get("content") or "").encode())
    rest = {k: v for k, v in message.items() if k not in ("role", "content")}
    return size + (len(json.dumps(rest, ensure_ascii=False).encode()) if rest else 0)


def worst_case_cost(endpoint: TeacherEndpointConfig, messages: list[dict[str, Any]], overhead: int) -> float:
    return call_cost(endpoint, prompt_token_bound(messages, overhead), endpoint.max_tokens)


@dataclass(frozen=True)
class Reservation:
    trace_id: str
    amount: float
    max_tokens: int | None = None
    """The ``max_tokens`` the request is sent with (``reserve_call``); None for a plain amount."""


class Budget:
    """Per-trace and per-run caps (``BudgetConfig``); thread- and task-safe."""

    def __init__(self, cfg: BudgetConfig, spent_by_trace: dict[str, float] | None = None) -> None:
        self.cfg = cfg
        self._lock = threading.Lock()
        self._spent: defaultdict[str, float] = defaultdict(float, spent_by_trace or {})
        self._reserved: defaultdict[str, float] = defaultdict(float)
        self._run_spent = sum(self._spent.values())
        self._run_reserved = 0.0
        self._in_flight = 0
        self._generation = 0
        self._waiters: list[asyncio.Future[None]] = []
        self._replies: dict[str, deque[int]] = {}

    # ------------------------------------------------------------------------------ reserving

    def _room(self, trace_id: str) -> float:
        """Dollars a new reservation of ``trace_id`` may take (inf without caps); under the lock."""
        room = math.inf
        if self.cfg.per_trace_usd is not None:
            room = self.cfg.per_trace_usd - self._spent[trace_id] - self._reserved[trace_id]
        if self.cfg.per_run_usd is not None:
            room = min(room, self.cfg.per_run_usd - self._run_spent - self._run_reserved)
        return room

    def _hold(self, trace_id: str, amount: float, max_tokens: int | None) -> Reservation:
        self._reserved[trace_id] += amount
        self._run_reserved += amount
        self._in_flight += 1
        return Reservation(trace_id, amount, max_tokens)

    def reserve(self, trace_id: str, amount: float) -> Reservation | None:
        """Hold ``amount`` dollars for one call of ``trace_id``; None when a cap would be exceeded."""
        with self._lock:
            if amount > self._room(trace_id):
                return None
            return self._hold(trace_id, amount, None)

    def reserve_call(
        self, trace_id: str, endpoint: TeacherEndpointConfig, prompt_tokens: int
    ) -> Reservation | None:
        """Hold the worst case of one request to ``endpoint`` (``prompt_tokens`` its bound): at its
        full ``max_tokens`` if that fits, else at the most output tokens the caps leave room for if
        that is at least the realistic reply bound; None when not even that fits."""
        prompt_usd = call_cost(endpoint, prompt_tokens, 0)
        per_token = call_cost(endpoint, 0, 1)
        with self._lock:
            room = self._room(trace_id) - prompt_usd
            full = prompt_usd + per_token * endpoint.max_tokens
            if full <= prompt_usd + room:
                return self._hold(trace_id, full, endpoint.max_tokens)
            if room < 0:
                return None
            tokens = min(endpoint.max_tokens, math.floor(room / per_token * (1 - 1e-12)))
            if tokens < self._reply_bound(endpoint):
                return None
            return self._hold(trace_id, prompt_usd + per_token * tokens, tokens)

    def settle(self, reservation: Reservation, actual: float) -> None:
        """Release ``reservation`` and record ``actual`` dollars spent (0 for a call that failed)."""
        if actual > reservation.amount + 1e-12:
            logger.warning(
                "a teacher call cost $%.6f, more than its reserved worst case $%.6f (the endpoint counted "
                "more prompt tokens than UTF-8 bytes: raise budget.prompt_overhead_tokens)",
                actual,
                reservation.amount,
            )
        with self._lock:
            self._reserved[reservation.trace_id] -= reservation.amount
            self._run_reserved -= reservation.amount
            self._spent[reservation.trace_id] += actual
            self._run_spent += actual
            self._in_flight -= 1
            self._generation += 1
            waiters, self._waiters = self._waiters, []
        for future in waiters:
            future.get_loop().call_soon_threadsafe(_wake, future)

    # -------------------------------------------------------------------------------- waiting

    @property
    def generation(self) -> int:
        """Settlements so far (read before asking, pass to ``wait_for_release``)."""
        with self._lock:
            return self._generation

    async def wait_for_release(self, since: int) -> bool:
        """Wait until a reservation settles after ``generation`` was ``since``; True at once when one
        did meanwhile, False at once when none is in flight (no money will free up)."""
        with self._lock:
            if self._generation != since:
                return True
            if self._in_flight == 0:
                return False
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(future)
        await future
        return True

    # ------------------------------------------------------------------------ realistic bound

    def observe_reply(self, endpoint_id: str, completion_tokens: int) -> None:
        """Record the length of an answer of ``endpoint_id`` (for its realistic reply bound)."""
        with self._lock:
            self._replies.setdefault(endpoint_id, deque(maxlen=REPLY_WINDOW)).append(completion_tokens)

    def reply_bound(self, endpoint: TeacherEndpointConfig) -> int:
        with self._lock:
            return self._reply_bound(endpoint)

    def _reply_bound(self, endpoint: TeacherEndpointConfig) -> int:
        seen = self._replies.get(endpoint.id)
        if seen is None or len(seen) < self.cfg.reply_samples:
            return endpoint.max_tokens
        ordered = sorted(seen)
        # The smallest observed length at or above the quantile (no interpolation: an upper bound).
        index = min(len(ordered) - 1, max(0, math.ceil(self.cfg.reply_quantile * len(ordered)) - 1))
        quantile = ordered[index]
        return min(endpoint.max_tokens, max(1, math.ceil(self.cfg.reply_margin * quantile)))

    # ---------------------------------------------------------------------------------- state

    def spent(self, trace_id: str | None = None) -> float:
        with self._lock:
            return self._run_spent if trace_id is None else self._spent[trace_id]

    def reserved(self) -> float:
        with self._lock:
            return self._run_reserved


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)

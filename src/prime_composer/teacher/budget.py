"""Hard spend caps that hold under concurrency: reserve the worst case, then settle.

Before each teacher call, ``Budget.reserve`` checks ``spent + reserved + worst_case <= cap`` for the
trace and for the run and, if it fits, adds ``worst_case`` to ``reserved`` in the same critical
section; after the call, ``settle`` moves the reservation to ``spent`` at the call's real cost
(which is at most the worst case). So any number of concurrent calls can only ever commit what the
caps allow, and a cap is never exceeded even if every call in flight costs its worst case.

The worst case of a call is its prompt's upper bound in tokens (UTF-8 bytes of the messages plus
``prompt_overhead_tokens`` for the chat template: a byte-level BPE spends at most one token per
byte) times the input price, plus ``max_tokens`` times the output price. A provider that reports
more tokens than that bound (a tokenizer that is not byte-level, hidden reasoning tokens) is
logged; its real cost is still what the ledger records.

Spending is rebuilt from the ledger at start, so the run cap holds across restarts.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from dataclasses import dataclass

from prime_composer.config.teacher import BudgetConfig, TeacherEndpointConfig

logger = logging.getLogger(__name__)

MILLION = 1_000_000


def call_cost(endpoint: TeacherEndpointConfig, input_tokens: int, output_tokens: int) -> float:
    """Dollars of one call at ``endpoint``'s prices."""
    return (input_tokens * endpoint.input_usd_per_m + output_tokens * endpoint.output_usd_per_m) / MILLION


def prompt_token_bound(messages: list[dict[str, str]], overhead: int) -> int:
    """Upper bound on the prompt tokens of ``messages`` for a byte-level tokenizer."""
    return overhead + sum(len(m["role"].encode()) + len(m["content"].encode()) + 8 for m in messages)


def worst_case_cost(endpoint: TeacherEndpointConfig, messages: list[dict[str, str]], overhead: int) -> float:
    return call_cost(endpoint, prompt_token_bound(messages, overhead), endpoint.max_tokens)


@dataclass(frozen=True)
class Reservation:
    trace_id: str
    amount: float


class Budget:
    """Per-trace and per-run caps (``BudgetConfig``); thread- and task-safe."""

    def __init__(self, cfg: BudgetConfig, spent_by_trace: dict[str, float] | None = None) -> None:
        self.cfg = cfg
        self._lock = threading.Lock()
        self._spent: defaultdict[str, float] = defaultdict(float, spent_by_trace or {})
        self._reserved: defaultdict[str, float] = defaultdict(float)
        self._run_spent = sum(self._spent.values())
        self._run_reserved = 0.0

    def reserve(self, trace_id: str, amount: float) -> Reservation | None:
        """Hold ``amount`` dollars for one call of ``trace_id``; None when a cap would be exceeded."""
        with self._lock:
            trace_cap, run_cap = self.cfg.per_trace_usd, self.cfg.per_run_usd
            if (
                trace_cap is not None
                and self._spent[trace_id] + self._reserved[trace_id] + amount > trace_cap
            ):
                return None
            if run_cap is not None and self._run_spent + self._run_reserved + amount > run_cap:
                return None
            self._reserved[trace_id] += amount
            self._run_reserved += amount
            return Reservation(trace_id, amount)

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

    def spent(self, trace_id: str | None = None) -> float:
        with self._lock:
            return self._run_spent if trace_id is None else self._spent[trace_id]

    def run_exhausted(self, smallest_call: float) -> bool:
        """Whether not even a call of ``smallest_call`` dollars fits the run cap any more."""
        if self.cfg.per_run_usd is None:
            return False
        with self._lock:
            return self._run_spent + self._run_reserved + smallest_call > self.cfg.per_run_usd

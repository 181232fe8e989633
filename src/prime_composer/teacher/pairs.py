"""The read side of the pair store: what the orchestrator's pair source takes into batches.

    store = PairStore(Path(output_dir) / "teacher" / "teacher.sqlite")
    pairs = store.take(64, after_cursor=cursor)     # ready pairs, oldest first
    cursor = pairs[-1].cursor if pairs else cursor  # checkpoint this integer to resume

A pair is *ready* once its token ids and reference logprobs are stored; ready pairs get cursors
1, 2, 3, ... in the order they became ready and never change afterwards, so ``after_cursor`` is a
complete resume position (like the orchestrator's data counters). The reader opens the SQLite
file in WAL mode next to the writing service and never blocks it; before the service has created
the file, ``take`` returns nothing. Only the standard library is imported here.

The reader is generated from ``Pair``'s fields: each is a column of the store's ``pairs`` table
(``store.py``'s schema) read under its own name, JSON-decoded where the field is a list or a dict;
the first read checks the file's table has every one of them (``PairStoreError`` naming the file
and the missing columns otherwise), so a schema change cannot silently drop a field.

Token layout of a pair, for the trainer's DPO term: the chosen sequence is
``context_ids + chosen_ids``, the rejected one ``context_ids + rejected_ids``; the loss tokens are
``chosen_ids`` and ``rejected_ids`` (each ends with the end-of-turn token), and
``ref_chosen_logprobs[i]`` is the reference model's log-probability (temperature 1) of
``chosen_ids[i]`` given everything before it (same for rejected). Their sums are the sequence
reference logprobs of ``trainer/losses/dpo.py``; their lengths its token counts.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_CURSOR = 2**63 - 1
"""The largest cursor there can be (SQLite's integers are 64-bit)."""


@dataclass(frozen=True)
class Pair:
    """One step-level preference pair, as the trainer will receive it."""

    cursor: int
    """Position in the ready order (1, 2, ...): resume with ``take(n, after_cursor=cursor)``."""
    trace_id: str
    turn_index: int
    """Index of the step's assistant turn in the trace."""
    state_hash: str
    context_ids: list[int]
    """The state, in the student's tokens (its chat template, generation prompt included)."""
    chosen_ids: list[int]
    """The action the teacher majority chose (or the student's own sample of it), end token included."""
    rejected_ids: list[int]
    """The trace's action."""
    ref_chosen_logprobs: list[float]
    """Reference logprob of each ``chosen_ids`` token (initial policy, temperature 1)."""
    ref_rejected_logprobs: list[float]
    label_smoothing: float
    """``1 - vote share`` of the majority, capped (``teacher.pairs.max_label_smoothing``)."""
    vote_share: float
    """Share of the valid teacher votes that went to the chosen action."""
    margin: float
    """Chosen share minus the trace action's share."""
    process_reward: float
    """The step's process reward (trace action's share minus the majority's), in [-1, 1]."""
    chosen_source: str
    """``teacher`` (the majority's action rendered in the student's format) or ``student`` (one of
    the student's own samples at this state that matched the majority)."""
    chosen_text: str
    rejected_text: str
    reference_model: str
    provenance: dict[str, Any]
    """Teachers asked, their votes by cluster, the cost of the step's calls."""

    @property
    def ref_chosen_logp(self) -> float:
        return sum(self.ref_chosen_logprobs)

    @property
    def ref_rejected_logp(self) -> float:
        return sum(self.ref_rejected_logprobs)


PAIR_FIELDS = tuple(f.name for f in dataclasses.fields(Pair))
"""The ``pairs`` columns a ``Pair`` is read from, in field order."""
_JSON_FIELDS = frozenset(
    f.name for f in dataclasses.fields(Pair) if str(f.type).startswith(("list[", "dict["))
)
_SELECT = f"SELECT {', '.join(PAIR_FIELDS)} FROM pairs"


class PairStoreError(RuntimeError):
    """The store's ``pairs`` table lacks columns a ``Pair`` is read from."""


class PairStore:
    """Read ready pairs from the service's store (any process, any time)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._conn: sqlite3.Connection | None = None
        self._checked = False

    def _connection(self) -> sqlite3.Connection | None:
        if self._conn is None and self.path.exists():
            self._conn = sqlite3.connect(
                self.path, timeout=60.0, isolation_level=None, check_same_thread=False
            )
            self._conn.row_factory = sqlite3.Row
            self._conn.execute("PRAGMA busy_timeout = 60000")
        if self._conn is not None and not self._checked:
            self._check_columns(self._conn)
        return self._conn

    def _check_columns(self, conn: sqlite3.Connection) -> None:
        """Once the service has made the ``pairs`` table: it has every column of ``PAIR_FIELDS``."""
        columns = {row["name"] for row in conn.execute("PRAGMA table_info(pairs)")}
        self._checked = bool(columns)
        missing = [name for name in PAIR_FIELDS if name not in columns] if columns else []
        if missing:
            raise PairStoreError(
                f"{self.path}: the pairs table has no column {', '.join(missing)}: the store was written "
                "by another version of the teacher service; start it again on a new store"
            )

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def newest_cursor(self) -> int:
        """The cursor of the newest ready pair (0 when none is ready)."""
        conn = self._connection()
        if conn is None:
            return 0
        row = conn.execute("SELECT COALESCE(MAX(cursor), 0) FROM pairs WHERE status = 'ready'").fetchone()
        return int(row[0])

    def take(self, n: int, after_cursor: int = 0) -> list[Pair]:
        """Up to ``n`` ready pairs with ``cursor > after_cursor``, in cursor order."""
        if n < 1:
            raise ValueError(f"PairStore.take: n must be at least 1, got {n}")
        if not 0 <= after_cursor <= MAX_CURSOR:
            raise ValueError(f"PairStore.take: after_cursor must be in [0, {MAX_CURSOR}], got {after_cursor}")
        conn = self._connection()
        if conn is None:
            return []
        rows = conn.execute(
            f"{_SELECT} WHERE status = 'ready' AND cursor > ? ORDER BY cursor LIMIT ?",
            (after_cursor, n),
        ).fetchall()
        return [_pair(r) for r in rows]

    def latest_cursor(self) -> int:
        """The cursor of the newest ready pair (0 when there is none)."""
        conn = self._connection()
        if conn is None:
            return 0
        row = conn.execute("SELECT COALESCE(MAX(cursor), 0) FROM pairs WHERE status = 'ready'").fetchone()
        return int(row[0])

    def count(self, after_cursor: int = 0) -> int:
        """Ready pairs after ``after_cursor``."""
        conn = self._connection()
        if conn is None:
            return 0
        row = conn.execute(
            "SELECT COUNT(*) FROM pairs WHERE status = 'ready' AND cursor > ?", (after_cursor,)
        )
        return int(row.fetchone()[0])

    def has_trace(self, trace_id: str) -> bool:
        """Whether the store holds a trace with this id."""
        conn = self._connection()
        if conn is None:
            return False
        row = conn.execute("SELECT 1 FROM traces WHERE trace_id = ?", (trace_id,)).fetchone()
        return row is not None

    def process_rewards(self, trace_id: str) -> dict[int, float]:
        """``turn_index -> process reward`` of every labeled step of a trace (pairs, confirmations
        and undecided steps alike)."""
        conn = self._connection()
        if conn is None:
            return {}
        rows = conn.execute(
            "SELECT turn_index, process_reward FROM steps WHERE trace_id = ? AND status = 'done'"
            " AND process_reward IS NOT NULL ORDER BY turn_index",
            (trace_id,),
        )
        return {r["turn_index"]: r["process_reward"] for r in rows}

    def votes_at(self, state_hash: str) -> list[str] | None:
        """The valid teacher votes (action cluster keys) at a state, from its labeled step with the
        most of them; None when no step at this state was labeled. Answers are cached per state, so
        every labeled step at a state saw the same answers; the cascade may have asked fewer teachers
        at some of them."""
        conn = self._connection()
        if conn is None:
            return None
        row = conn.execute(
            "SELECT votes FROM steps WHERE state_hash = ? AND status = 'done' AND num_votes > 0"
            " ORDER BY num_votes DESC LIMIT 1",
            (state_hash,),
        ).fetchone()
        if row is None:
            return None
        return [v["action"] for v in json.loads(row["votes"]) if v.get("action") is not None]


def _pair(r: sqlite3.Row) -> Pair:
    return Pair(**{name: json.loads(r[name]) if name in _JSON_FIELDS else r[name] for name in PAIR_FIELDS})

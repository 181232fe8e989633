"""The service's SQLite store: traces, step plans and labels, response cache, cost ledger, pairs.

One file, ``<output_dir>/teacher/teacher.sqlite``, in WAL mode: the service writes, the
orchestrator's pair source reads at the same time (``pairs.PairStore``) without blocking it. Every
state change is one transaction, so a SIGKILL leaves the store as it was after the last finished
change, and a restart continues from there:

- ``traces``: one row per trace (``record`` is its canonical JSON); ``status`` new -> planned -> done.
- ``steps``: the gate's plan for a trace (every step with its features, score, expected cost and
  whether it was selected), written once, so a restart asks the same steps; then each selected
  step's label: ``outcome`` (pair | confirmed | undecided | no_votes | budget), process reward,
  shares, votes and cost.
- ``responses``: the response cache, keyed by ``sha256(teacher, model, prompt hash, sampling)``;
  a cached answer is never paid for again.
- ``ledger``: one row per attempted call (and per cache hit or budget refusal): teacher, model,
  tokens in/out, dollars, latency, attempts, outcome (ok | malformed | cache_hit | budget | timeout
  | step_deadline | connection | http_<status> | bad_json | bad_response | too_large |
  too_many_tokens | orphaned) and the error message.
- ``reservations``: one row per teacher call in flight, written (and updated before each retry)
  before its request is sent, holding what it may cost at most (the known cost of its finished
  attempts plus the worst case of the current one); the transaction that records the call's ledger
  row removes it. A row left by a process that died becomes, at the next start, a ledger row of
  outcome ``orphaned`` at that worst case (``settle_orphans``): the ledger never undercounts what a
  provider may have billed.
- ``pairs``: one row per (state hash, chosen action, rejected action), so a pair is never written
  twice; ``status`` pending_ref -> ready (token ids and reference logprobs filled in, ``cursor``
  assigned in increasing order) or too_long / failed.
- ``import_errors``: rejected trace lines, with the message.

A call's ledger row and its cache entry are written in one transaction: either the answer is
cached and its cost recorded, or neither (the call is then made again after a restart).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prime_composer.teacher.traces import Trace, TraceRecord

SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS traces (
    trace_id TEXT PRIMARY KEY,
    source TEXT NOT NULL,
    record TEXT NOT NULL,
    num_steps INTEGER NOT NULL,
    reward REAL,
    status TEXT NOT NULL DEFAULT 'new',
    added_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS traces_status ON traces (status);
CREATE TABLE IF NOT EXISTS steps (
    trace_id TEXT NOT NULL,
    turn_index INTEGER NOT NULL,
    state_hash TEXT NOT NULL,
    features TEXT NOT NULL,
    score REAL NOT NULL,
    expected_usd REAL NOT NULL,
    selected INTEGER NOT NULL,
    status TEXT NOT NULL,
    outcome TEXT,
    process_reward REAL,
    trace_share REAL,
    best_share REAL,
    num_votes INTEGER,
    votes TEXT,
    cost_usd REAL,
    action_key TEXT,
    PRIMARY KEY (trace_id, turn_index)
);
CREATE INDEX IF NOT EXISTS steps_state ON steps (state_hash, status);
CREATE TABLE IF NOT EXISTS responses (
    cache_key TEXT PRIMARY KEY,
    teacher TEXT NOT NULL,
    model TEXT NOT NULL,
    prompt_hash TEXT NOT NULL,
    sampling TEXT NOT NULL,
    message TEXT,
    action TEXT,
    parse_error TEXT,
    input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    dollars REAL NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS ledger (
    call_id INTEGER PRIMARY KEY AUTOINCREMENT,
    time REAL NOT NULL,
    trace_id TEXT,
    turn_index INTEGER,
    teacher TEXT NOT NULL,
    model TEXT NOT NULL,
    cache_key TEXT,
    input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    dollars REAL NOT NULL,
    latency_s REAL NOT NULL,
    attempts INTEGER NOT NULL,
    outcome TEXT NOT NULL,
    error TEXT
);
CREATE INDEX IF NOT EXISTS ledger_trace ON ledger (trace_id);
CREATE TABLE IF NOT EXISTS pairs (
    pair_id INTEGER PRIMARY KEY AUTOINCREMENT,
    cursor INTEGER UNIQUE,
    status TEXT NOT NULL,
    status_reason TEXT,
    trace_id TEXT NOT NULL,
    turn_index INTEGER NOT NULL,
    state_hash TEXT NOT NULL,
    chosen_key TEXT NOT NULL,
    rejected_key TEXT NOT NULL,
    context_messages TEXT NOT NULL,
    chosen_text TEXT NOT NULL,
    rejected_text TEXT NOT NULL,
    context_ids TEXT,
    chosen_ids TEXT,
    rejected_ids TEXT,
    ref_chosen_logprobs TEXT,
    ref_rejected_logprobs TEXT,
    reference_model TEXT,
    chosen_source TEXT NOT NULL,
    label_smoothing REAL NOT NULL,
    vote_share REAL NOT NULL,
    margin REAL NOT NULL,
    process_reward REAL NOT NULL,
    provenance TEXT NOT NULL,
    created_at REAL NOT NULL,
    UNIQUE (state_hash, chosen_key, rejected_key)
);
CREATE INDEX IF NOT EXISTS pairs_status ON pairs (status);
CREATE TABLE IF NOT EXISTS reservations (
    reservation_id INTEGER PRIMARY KEY AUTOINCREMENT,
    time REAL NOT NULL,
    trace_id TEXT,
    turn_index INTEGER,
    teacher TEXT NOT NULL,
    model TEXT NOT NULL,
    cache_key TEXT,
    dollars REAL NOT NULL,
    attempts INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS import_errors (
    source TEXT NOT NULL,
    line INTEGER NOT NULL,
    error TEXT NOT NULL,
    time REAL NOT NULL,
    PRIMARY KEY (source, line)
);
"""


def connect(path: Path) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit), WAL, waiting up to 60 s for
    another writer's lock."""
    conn = sqlite3.connect(path, timeout=60.0, isolation_level=None, check_same_thread=False)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA busy_timeout = 60000")
    return conn


@dataclass(frozen=True)
class PlannedStep:
    """One row of a trace's plan."""

    turn_index: int
    state_hash: str
    features: dict[str, float]
    score: float
    expected_usd: float
    selected: bool
    action_key: str | None = None
    """The trace's action at the step (``Action.key``): with the state, what a label judges."""


@dataclass(frozen=True)
class LedgerRow:
    trace_id: str | None
    turn_index: int | None
    teacher: str
    model: str
    cache_key: str | None
    input_tokens: int
    output_tokens: int
    dollars: float
    latency_s: float
    attempts: int
    outcome: str
    error: str | None = None


@dataclass(frozen=True)
class CachedResponse:
    message: dict[str, Any] | None
    action: Any
    """The canonical action as stored (``actions.action_to_json``), or None."""
    parse_error: str | None
    input_tokens: int
    output_tokens: int
    dollars: float


@dataclass(frozen=True)
class PairCandidate:
    """A pair before tokenization and reference logprobs (``ReferenceScorer`` fills those)."""

    trace_id: str
    turn_index: int
    state_hash: str
    chosen_key: str
    rejected_key: str
    context_messages: list[dict[str, str]]
    chosen_text: str
    rejected_text: str
    context_ids: list[int] | None
    """Exact context tokens from the trace, when it has them."""
    chosen_ids: list[int] | None
    """The student's own tokens for the chosen side (on-policy), when one matched."""
    rejected_ids: list[int] | None
    """The trace's sampled tokens of the rejected action, when it has them."""
    chosen_source: str
    label_smoothing: float
    vote_share: float
    margin: float
    process_reward: float
    provenance: dict[str, Any]


class TeacherStore:
    """The service's read-write view of the store (one per thread: SQLite connections are not
    shared)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = connect(self.path)
        self._conn.execute("PRAGMA journal_mode = WAL")
        # NORMAL in WAL mode: a committed transaction survives a process crash (SIGKILL); only a power
        # loss may drop the last ones.
        self._conn.execute("PRAGMA synchronous = NORMAL")
        self._conn.executescript(SCHEMA)  # idempotent (IF NOT EXISTS)
        columns = {r["name"] for r in self._conn.execute("PRAGMA table_info(steps)")}
        if "action_key" not in columns:  # a store written before steps kept their action
            self._conn.execute("ALTER TABLE steps ADD COLUMN action_key TEXT")
        row = self._conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if row is None:
            self._conn.execute(
                "INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
            )
        elif int(row["value"]) != SCHEMA_VERSION:
            raise ValueError(
                f"{self.path}: store schema version {row['value']}, this code reads {SCHEMA_VERSION}; "
                "use a new output_dir or the version that wrote it"
            )

    def close(self) -> None:
        self._conn.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield self._conn
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    # ---------------------------------------------------------------------------------- traces

    def add_trace(self, trace: Trace) -> str | None:
        """Add ``trace``; None when added or already there with the same content, else a message
        (its id is taken by a different trace)."""
        record = trace.to_json()
        with self._tx() as c:
            row = c.execute("SELECT record FROM traces WHERE trace_id = ?", (trace.trace_id,)).fetchone()
            if row is not None:
                if row["record"] == record:
                    return None
                return (
                    f"{trace.source}: trace id {trace.trace_id!r} is already in the store with other content"
                )
            c.execute(
                "INSERT INTO traces (trace_id, source, record, num_steps, reward, added_at) VALUES (?,?,?,?,?,?)",
                (
                    trace.trace_id,
                    trace.source,
                    record,
                    len(trace.step_indices),
                    trace.record.reward,
                    time.time(),
                ),
            )
        return None

    def record_import_error(self, source: str, line: int, error: str) -> None:
        with self._tx() as c:
            c.execute(
                "INSERT OR REPLACE INTO import_errors VALUES (?,?,?,?)", (source, line, error, time.time())
            )

    def import_errors(self) -> list[tuple[str, int, str]]:
        rows = self._conn.execute("SELECT source, line, error FROM import_errors ORDER BY source, line")
        return [(r["source"], r["line"], r["error"]) for r in rows]

    def pending_traces(self) -> list[str]:
        rows = self._conn.execute("SELECT trace_id FROM traces WHERE status != 'done' ORDER BY rowid")
        return [r["trace_id"] for r in rows]

    def load_trace(self, trace_id: str) -> Trace:
        row = self._conn.execute(
            "SELECT source, record FROM traces WHERE trace_id = ?", (trace_id,)
        ).fetchone()
        if row is None:
            raise KeyError(trace_id)
        return Trace(trace_id, TraceRecord.model_validate_json(row["record"]), row["source"])

    def mark_trace_done(self, trace_id: str) -> None:
        with self._tx() as c:
            c.execute("UPDATE traces SET status = 'done' WHERE trace_id = ?", (trace_id,))

    # ----------------------------------------------------------------------------------- steps

    def plan(self, trace_id: str) -> list[PlannedStep] | None:
        """The stored plan of ``trace_id``, or None if it was never planned."""
        rows = self._conn.execute(
            "SELECT * FROM steps WHERE trace_id = ? ORDER BY turn_index", (trace_id,)
        ).fetchall()
        if not rows:
            return None
        return [
            PlannedStep(
                r["turn_index"],
                r["state_hash"],
                json.loads(r["features"]),
                r["score"],
                r["expected_usd"],
                bool(r["selected"]),
                r["action_key"],
            )
            for r in rows
        ]

    def save_plan(self, trace_id: str, steps: list[PlannedStep]) -> None:
        with self._tx() as c:
            for s in steps:
                c.execute(
                    "INSERT OR IGNORE INTO steps (trace_id, turn_index, state_hash, features, score, expected_usd,"
                    " selected, status, action_key) VALUES (?,?,?,?,?,?,?,?,?)",
                    (
                        trace_id,
                        s.turn_index,
                        s.state_hash,
                        json.dumps(s.features),
                        s.score,
                        s.expected_usd,
                        int(s.selected),
                        "pending" if s.selected else "skipped",
                        s.action_key,
                    ),
                )
            c.execute("UPDATE traces SET status = 'planned' WHERE trace_id = ?", (trace_id,))

    def pending_steps(self, trace_id: str) -> list[int]:
        rows = self._conn.execute(
            "SELECT turn_index FROM steps WHERE trace_id = ? AND status = 'pending' ORDER BY turn_index",
            (trace_id,),
        )
        return [r["turn_index"] for r in rows]

    def step_evaluated(self, state_hash: str, action_key: str) -> bool:
        """Whether this action at this state was labeled before (the gate's novelty). A step of a
        store written before steps kept their action counts for every action at its state."""
        row = self._conn.execute(
            "SELECT 1 FROM steps WHERE state_hash = ? AND status = 'done'"
            " AND (action_key = ? OR action_key IS NULL) LIMIT 1",
            (state_hash, action_key),
        ).fetchone()
        return row is not None

    def finish_step(
        self,
        trace_id: str,
        turn_index: int,
        *,
        status: str,
        outcome: str,
        process_reward: float | None,
        trace_share: float | None,
        best_share: float | None,
        num_votes: int,
        votes: list[dict[str, Any]],
        cost_usd: float,
        pair: PairCandidate | None,
    ) -> bool:
        """Store a step's label and its pair candidate in one transaction; False when the pair was a
        duplicate of one already stored (same state, chosen and rejected)."""
        inserted = False
        with self._tx() as c:
            c.execute(
                "UPDATE steps SET status = ?, outcome = ?, process_reward = ?, trace_share = ?, best_share = ?,"
                " num_votes = ?, votes = ?, cost_usd = ? WHERE trace_id = ? AND turn_index = ?",
                (
                    status,
                    outcome,
                    process_reward,
                    trace_share,
                    best_share,
                    num_votes,
                    json.dumps(votes),
                    cost_usd,
                    trace_id,
                    turn_index,
                ),
            )
            if pair is not None:
                cursor = c.execute(
                    "INSERT OR IGNORE INTO pairs (status, trace_id, turn_index, state_hash, chosen_key, rejected_key,"
                    " context_messages, chosen_text, rejected_text, context_ids, chosen_ids, rejected_ids,"
                    " chosen_source, label_smoothing, vote_share, margin, process_reward, provenance, created_at)"
                    " VALUES ('pending_ref',?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        pair.trace_id,
                        pair.turn_index,
                        pair.state_hash,
                        pair.chosen_key,
                        pair.rejected_key,
                        json.dumps(pair.context_messages),
                        pair.chosen_text,
                        pair.rejected_text,
                        _json_or_none(pair.context_ids),
                        _json_or_none(pair.chosen_ids),
                        _json_or_none(pair.rejected_ids),
                        pair.chosen_source,
                        pair.label_smoothing,
                        pair.vote_share,
                        pair.margin,
                        pair.process_reward,
                        json.dumps(pair.provenance, sort_keys=True),
                        time.time(),
                    ),
                )
                inserted = cursor.rowcount == 1
        return inserted

    # ----------------------------------------------------------------------- cache and ledger

    def cached(self, cache_key: str) -> CachedResponse | None:
        r = self._conn.execute("SELECT * FROM responses WHERE cache_key = ?", (cache_key,)).fetchone()
        if r is None:
            return None
        return CachedResponse(
            message=json.loads(r["message"]) if r["message"] else None,
            action=json.loads(r["action"]) if r["action"] else None,
            parse_error=r["parse_error"],
            input_tokens=r["input_tokens"],
            output_tokens=r["output_tokens"],
            dollars=r["dollars"],
        )

    def reserve_call(self, reservation_id: int | None, row: LedgerRow) -> int:
        """Write (or, with ``reservation_id``, update) the durable reservation of a call about to be
        sent: ``row.dollars`` is the most it may cost, ``row.attempts`` the attempts it covers.
        Committed before the request leaves."""
        with self._tx() as c:
            if reservation_id is not None:
                c.execute(
                    "UPDATE reservations SET dollars = ?, attempts = ?, time = ? WHERE reservation_id = ?",
                    (row.dollars, row.attempts, time.time(), reservation_id),
                )
                return reservation_id
            cursor = c.execute(
                "INSERT INTO reservations (time, trace_id, turn_index, teacher, model, cache_key, dollars,"
                " attempts) VALUES (?,?,?,?,?,?,?,?)",
                (
                    time.time(), row.trace_id, row.turn_index, row.teacher, row.model, row.cache_key,
                    row.dollars, row.attempts,
                ),
            )  # fmt: skip
            assert cursor.lastrowid is not None
            return cursor.lastrowid

    def reservations(self) -> list[dict[str, Any]]:
        """Calls in flight (or orphaned by a process that died, before ``settle_orphans``)."""
        return [dict(r) for r in self._conn.execute("SELECT * FROM reservations ORDER BY reservation_id")]

    def settle_orphans(self) -> tuple[int, float]:
        """Charge every reservation left by a process that died at its worst case (ledger outcome
        ``orphaned``), in one transaction; returns how many and their dollars. Only the process
        holding the store's lock may call it (no call of its own is in flight yet)."""
        with self._tx() as c:
            rows = c.execute("SELECT * FROM reservations ORDER BY reservation_id").fetchall()
            for r in rows:
                c.execute(
                    "INSERT INTO ledger (time, trace_id, turn_index, teacher, model, cache_key, input_tokens,"
                    " output_tokens, dollars, latency_s, attempts, outcome, error)"
                    " VALUES (?,?,?,?,?,?,0,0,?,0,?,'orphaned',?)",
                    (
                        time.time(), r["trace_id"], r["turn_index"], r["teacher"], r["model"], r["cache_key"],
                        r["dollars"], r["attempts"],
                        "the service stopped with this call in flight; charged its reserved worst case "
                        "(the provider may have billed it)",
                    ),
                )  # fmt: skip
            c.execute("DELETE FROM reservations")
        return len(rows), sum(r["dollars"] for r in rows)

    def record_call(
        self, row: LedgerRow, cache: dict[str, Any] | None = None, reservation_id: int | None = None
    ) -> None:
        """Append a ledger row and, for a paid answer, its cache entry, in one transaction that also
        removes the call's durable reservation (``reservation_id``), if it had one.

        ``cache`` holds ``prompt_hash``, ``sampling`` (JSON text), ``message``, ``action`` and
        ``parse_error``; the tokens and dollars come from ``row``.
        """
        with self._tx() as c:
            if reservation_id is not None:
                c.execute("DELETE FROM reservations WHERE reservation_id = ?", (reservation_id,))
            c.execute(
                "INSERT INTO ledger (time, trace_id, turn_index, teacher, model, cache_key, input_tokens,"
                " output_tokens, dollars, latency_s, attempts, outcome, error) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    time.time(),
                    row.trace_id,
                    row.turn_index,
                    row.teacher,
                    row.model,
                    row.cache_key,
                    row.input_tokens,
                    row.output_tokens,
                    row.dollars,
                    row.latency_s,
                    row.attempts,
                    row.outcome,
                    row.error,
                ),
            )
            if cache is not None:
                c.execute(
                    "INSERT OR IGNORE INTO responses VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        row.cache_key,
                        row.teacher,
                        row.model,
                        cache["prompt_hash"],
                        cache["sampling"],
                        json.dumps(cache["message"]) if cache["message"] is not None else None,
                        json.dumps(cache["action"]) if cache["action"] is not None else None,
                        cache["parse_error"],
                        row.input_tokens,
                        row.output_tokens,
                        row.dollars,
                        time.time(),
                    ),
                )

    def steps(self) -> list[dict[str, Any]]:
        """Every planned step with its label (``steps`` table rows)."""
        return [dict(r) for r in self._conn.execute("SELECT * FROM steps ORDER BY trace_id, turn_index")]

    def pairs(self) -> list[dict[str, Any]]:
        """Every pair row, whatever its status (``PairStore`` hands out the ready ones)."""
        return [dict(r) for r in self._conn.execute("SELECT * FROM pairs ORDER BY pair_id")]

    def _labeled(self) -> list[tuple[dict[str, float], float, int]]:
        """``(features, score at planning, 1 disagreed / 0 confirmed)`` of the labeled steps, in the
        order the steps were planned."""
        from prime_composer.teacher.voi import label_of

        rows = self._conn.execute(
            "SELECT features, score, outcome FROM steps WHERE status = 'done' ORDER BY rowid"
        )
        out = []
        for r in rows:
            y = label_of(r["outcome"])
            if y is not None:
                out.append((json.loads(r["features"]), float(r["score"]), y))
        return out

    def gate_examples(self) -> list[tuple[dict[str, float], float, int]]:
        """The calibrated gate's training examples: ``(features, prior, label)`` per labeled step."""
        return [(f, float(f.get("prior", score)), y) for f, score, y in self._labeled()]

    def gate_calibration(self) -> dict[str, float]:
        """Calibration of what ranked the steps (their stored score) against their labels."""
        from prime_composer.teacher.voi import calibration

        labeled = self._labeled()
        report = calibration([min(1.0, max(0.0, s)) for _, s, _ in labeled], [y for _, _, y in labeled])
        return {"labels": report.count, "ece": report.ece, "brier": report.brier}

    def spent_by_trace(self) -> dict[str, float]:
        """Dollars per trace in the ledger (calls without a trace under ``""``)."""
        rows = self._conn.execute(
            "SELECT COALESCE(trace_id, '') AS t, SUM(dollars) AS d FROM ledger GROUP BY t"
        )
        return {r["t"]: r["d"] or 0.0 for r in rows}

    def ledger(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._conn.execute("SELECT * FROM ledger ORDER BY call_id")]

    # ----------------------------------------------------------------------------------- pairs

    def pairs_needing_reference(self, limit: int) -> list[sqlite3.Row]:
        return self._conn.execute(
            "SELECT * FROM pairs WHERE status = 'pending_ref' ORDER BY pair_id LIMIT ?", (limit,)
        ).fetchall()

    def set_pair_ready(
        self,
        pair_id: int,
        *,
        context_ids: list[int],
        chosen_ids: list[int],
        rejected_ids: list[int],
        ref_chosen: list[float],
        ref_rejected: list[float],
        reference_model: str,
    ) -> None:
        """Fill in a pair's tokens and reference logprobs and give it the next cursor."""
        with self._tx() as c:
            c.execute(
                "UPDATE pairs SET status = 'ready', context_ids = ?, chosen_ids = ?, rejected_ids = ?,"
                " ref_chosen_logprobs = ?, ref_rejected_logprobs = ?, reference_model = ?,"
                " cursor = (SELECT COALESCE(MAX(cursor), 0) + 1 FROM pairs) WHERE pair_id = ? AND status = 'pending_ref'",
                (
                    json.dumps(context_ids),
                    json.dumps(chosen_ids),
                    json.dumps(rejected_ids),
                    json.dumps(ref_chosen),
                    json.dumps(ref_rejected),
                    reference_model,
                    pair_id,
                ),
            )

    def set_pair_status(self, pair_id: int, status: str, reason: str) -> None:
        with self._tx() as c:
            c.execute(
                "UPDATE pairs SET status = ?, status_reason = ? WHERE pair_id = ?", (status, reason, pair_id)
            )

    # ----------------------------------------------------------------------------------- stats

    def stats(self) -> dict[str, Any]:
        """Counts and spend, for ``GET /v1/stats`` and the process's metrics."""

        def grouped(sql: str) -> dict[str, Any]:
            return {r[0]: r[1] for r in self._conn.execute(sql)}

        ledger = self._conn.execute(
            "SELECT COUNT(*) AS n, COALESCE(SUM(dollars), 0) AS d, COALESCE(SUM(input_tokens), 0) AS i,"
            " COALESCE(SUM(output_tokens), 0) AS o FROM ledger WHERE outcome NOT IN ('cache_hit', 'budget')"
        ).fetchone()
        votes = self._conn.execute(
            "SELECT COALESCE(SUM(ROUND(trace_share * num_votes)), 0) AS agree, COALESCE(SUM(num_votes), 0) AS n"
            " FROM steps WHERE status = 'done' AND num_votes > 0"
        ).fetchone()
        return {
            "traces": grouped("SELECT status, COUNT(*) FROM traces GROUP BY status"),
            "votes": {"for_trace": int(votes["agree"]), "total": int(votes["n"])},
            "steps": grouped("SELECT COALESCE(outcome, status), COUNT(*) FROM steps GROUP BY 1"),
            "pairs": grouped("SELECT status, COUNT(*) FROM pairs GROUP BY status"),
            "calls": grouped("SELECT outcome, COUNT(*) FROM ledger GROUP BY outcome"),
            "calls_paid": ledger["n"],
            "spent_usd": ledger["d"],
            "input_tokens": ledger["i"],
            "output_tokens": ledger["o"],
            "spent_usd_by_teacher": grouped("SELECT teacher, SUM(dollars) FROM ledger GROUP BY teacher"),
            "import_errors": self._conn.execute("SELECT COUNT(*) FROM import_errors").fetchone()[0],
            "gate": self.gate_calibration(),
        }


def _json_or_none(value: list[int] | None) -> str | None:
    return None if value is None else json.dumps(value)

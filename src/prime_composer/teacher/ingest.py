"""``POST /v1/traces`` bodies, parsed, validated and stored in a worker process.

Why a process and not a thread: ``json.loads`` of a maximal body (16 x ``traces.max_line_bytes``,
64 MB by default) runs ~0.2 s as one C call that holds the interpreter lock, and pydantic's
validation of a large trace likewise; in a thread that would still stall the event loop, and
``/health`` with it. The worker holds its own SQLite connection; WAL mode and ``BEGIN IMMEDIATE``
serialize its writes with the service's.

A body is refused as a whole (400, with the reason) when it is not JSON, is nested deeper than
``traces.max_json_depth`` anywhere (the limit counts from a trace's own object), or is not
``{"traces": [...]}``; otherwise each trace is accepted or rejected on its own, as from a file.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prime_composer.config.teacher import TraceSourceConfig
from prime_composer.teacher.store import TeacherStore
from prime_composer.teacher.traces import TraceError, nested_deeper_than, parse_trace


@dataclass(frozen=True)
class IngestResult:
    status: int
    """200 (see ``body``) or 400 (``body["detail"]`` says why)."""
    body: dict[str, Any]


WORKER_NICENESS = 10

_worker: tuple[TeacherStore, TraceSourceConfig] | None = None


def _init_worker(store_path: str, limits: dict[str, Any]) -> None:
    global _worker
    os.nice(WORKER_NICENESS)  # parsing is background work: the routes come first on a busy machine
    _worker = (TeacherStore(Path(store_path)), TraceSourceConfig.model_validate(limits))


def _ready() -> bool:
    return _worker is not None


def ingest_body(body: bytes | bytearray, store: TeacherStore, limits: TraceSourceConfig) -> IngestResult:
    """Parse ``body``, store every valid trace; what the route answers."""
    try:
        data = json.loads(body)
    except RecursionError:
        return _bad(f"the body is nested deeper than traces.max_json_depth = {limits.max_json_depth}")
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, or an integer of > 4300 digits
        return _bad(f"the body is not JSON: {e}")
    if not isinstance(data, dict) or not isinstance(data.get("traces"), list):
        return _bad('the body must be {"traces": [trace, ...]}')
    for i, raw in enumerate(data["traces"]):
        if nested_deeper_than(raw, limits.max_json_depth):
            return _bad(f"traces[{i}] is nested deeper than traces.max_json_depth = {limits.max_json_depth}")
    accepted, rejected = [], []
    for i, raw in enumerate(data["traces"]):
        try:
            trace = parse_trace(raw, f"http traces[{i}]", limits)
        except TraceError as e:
            rejected.append({"index": i, "error": str(e)})
            continue
        conflict = store.add_trace(trace)
        if conflict is not None:
            rejected.append({"index": i, "error": conflict})
        else:
            accepted.append(trace.trace_id)
    return IngestResult(200, {"accepted": accepted, "rejected": rejected})


def _bad(detail: str) -> IngestResult:
    return IngestResult(400, {"detail": detail})


def _ingest_in_worker(body: bytes | bytearray) -> IngestResult:
    assert _worker is not None, "the worker's initializer did not run"
    return ingest_body(body, *_worker)


class TraceIngestor:
    """One worker process that takes bodies in turn (started now, so the first POST does not wait
    for its imports); a worker that dies is replaced and the request answered 503."""

    def __init__(self, store_path: Path, limits: TraceSourceConfig) -> None:
        self._args = (str(store_path), limits.model_dump(mode="json"))
        self._pool = self._start()

    def _start(self) -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(
            max_workers=1,
            mp_context=multiprocessing.get_context("spawn"),  # no fork of a process with threads
            initializer=_init_worker,
            initargs=self._args,
        )
        pool.submit(_ready)
        return pool

    async def ingest(self, body: bytes | bytearray) -> IngestResult:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, _ingest_in_worker, body)
        except BrokenProcessPool:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = self._start()
            return IngestResult(
                503,
                {
                    "detail": "the trace worker died on this body (traces before it may be stored; sending them again adds nothing twice)"
                },
            )

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

"""The service's HTTP routes (FastAPI), for the run's orchestrator and for people watching a run.

    GET  /health                        {"status": "ok"}                       (no secret needed)
    GET  /v1/stats                      counts of traces, steps, pairs, calls by outcome, spend
    POST /v1/traces  {"traces": [...]}  add traces (the JSONL schema of ``traces.py``), e.g. the
                                        run's own rollouts; answers {"accepted": [ids],
                                        "rejected": [{"index": i, "error": "..."}]}
    GET  /v1/pairs?after=C&limit=N      ready pairs with cursor > C (``pairs.Pair`` fields)
    GET  /v1/process_rewards/{trace_id} {"rewards": {turn_index: reward}}; 404 for an unknown trace
    GET  /openapi.json                  the schema of these routes

The service binds ``127.0.0.1`` by default. Bound to anything else it refuses to start without
``secret_env``; with a secret, every path but ``/health`` (the schema and unknown paths included)
needs ``Authorization: Bearer <secret>`` (compared in constant time, never logged).

Hostile input gets a 4xx, never a 500: a body larger than ``16 * traces.max_line_bytes`` is
refused before it is read whole (413); one that is not JSON, nests deeper than
``traces.max_json_depth`` or holds an integer of thousands of digits is refused (400); a cursor
beyond SQLite's 64-bit integers or a trace id outside ``traces.TRACE_ID_PATTERN`` is refused
(422). Bodies are parsed and stored in a worker process (``ingest.py``) and reads run in a thread,
so the event loop only moves bytes and ``/health`` answers at once during a maximal POST.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import FastAPI, HTTPException, Path, Query, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from prime_composer.config.teacher import TeacherServiceConfig
from prime_composer.inference.auth import serving_secret
from prime_composer.teacher.ingest import TraceIngestor
from prime_composer.teacher.pairs import MAX_CURSOR, PairStore
from prime_composer.teacher.store import TeacherStore
from prime_composer.teacher.traces import TRACE_ID_PATTERN

MAX_PAIRS_PER_REQUEST = 1000
T = TypeVar("T")


def resolve_secret(host: str, secret_env: str | None) -> str | None:
    """The shared secret requests must carry (None: loopback without a secret); ``ValueError``
    naming ``teacher.secret_env`` when the service would be reachable without one."""
    return serving_secret(host, secret_env, "teacher")


class SecretMiddleware:
    """Every path but ``/health`` needs the bearer secret (checked before routing, so the schema,
    the docs and unknown paths are covered as well)."""

    def __init__(self, app: ASGIApp, secret: str) -> None:
        self.app, self.secret = app, secret.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            headers = dict(scope["headers"])
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            error = None
            if scheme.lower() != "bearer" or not token:
                error = "missing shared secret: send 'Authorization: Bearer <secret>'"
            elif not hmac.compare_digest(token.strip().encode("latin-1"), self.secret):
                error = "wrong shared secret"
            if error is not None:
                await JSONResponse({"detail": error}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Reads:
    """The routes' read-only queries, on connections of their own, one at a time in a thread."""

    def __init__(self, cfg: TeacherServiceConfig) -> None:
        self.store = TeacherStore(cfg.store_path)
        self.pairs = PairStore(cfg.store_path)
        self._lock = threading.Lock()

    async def run(self, fn: Callable[[], T]) -> T:
        def locked() -> T:
            with self._lock:
                return fn()

        return await asyncio.to_thread(locked)

    def close(self) -> None:
        self.pairs.close()
        self.store.close()


def build_app(
    cfg: TeacherServiceConfig,
    secret: str | None,
    ingestor: TraceIngestor,
    on_traces: Callable[[], None] | None = None,
) -> tuple[FastAPI, Callable[[], None]]:
    """The routes over the store at ``cfg.store_path`` and a function that closes their
    connections; ``ingestor`` parses and stores POSTed traces, ``on_traces`` is called when some
    were added, so an idle replay loop starts on them at once."""
    app = FastAPI(title="prime-composer teacher", docs_url=None, redoc_url=None)
    if secret is not None:
        app.add_middleware(SecretMiddleware, secret=secret)
    reads = _Reads(cfg)
    max_body = 16 * cfg.traces.max_line_bytes

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/stats")
    async def stats() -> dict[str, Any]:
        return await reads.run(reads.store.stats)

    @app.post("/v1/traces")
    async def add_traces(request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body:
            raise HTTPException(
                413, f"body of {declared} bytes is larger than {max_body} (16 x traces.max_line_bytes)"
            )
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body:
                raise HTTPException(413, f"body larger than {max_body} bytes (16 x traces.max_line_bytes)")
        result = await ingestor.ingest(body)  # as it is: a copy of 64 MB would hold the loop
        if result.status != 200:
            return JSONResponse(result.body, status_code=result.status)
        if result.body["accepted"] and on_traces is not None:
            on_traces()
        return result.body

    @app.get("/v1/pairs")
    async def get_pairs(
        after: int = Query(0, ge=0, le=MAX_CURSOR),
        limit: int = Query(100, ge=1, le=MAX_PAIRS_PER_REQUEST),
    ) -> dict[str, Any]:
        taken = await reads.run(lambda: reads.pairs.take(limit, after_cursor=after))
        return {
            "pairs": [dataclasses.asdict(p) for p in taken],
            "cursor": taken[-1].cursor if taken else after,
        }

    @app.get("/v1/process_rewards/{trace_id}")
    async def process_rewards(
        trace_id: str = Path(max_length=200, pattern=TRACE_ID_PATTERN),
    ) -> dict[str, Any]:
        def known_rewards() -> dict[int, float] | None:
            if not reads.pairs.has_trace(trace_id):
                return None
            return reads.pairs.process_rewards(trace_id)

        rewards = await reads.run(known_rewards)
        if rewards is None:
            raise HTTPException(404, f"no trace {trace_id!r} in the store")
        return {"trace_id": trace_id, "rewards": rewards}

    return app, reads.close

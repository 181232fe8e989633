"""The service's HTTP routes (FastAPI), for the run's orchestrator and for people watching a run.

    GET  /health                        {"status": "ok"}                       (no secret needed)
    GET  /v1/stats                      counts of traces, steps, pairs, calls by outcome, spend
    POST /v1/traces  {"traces": [...]}  add traces (the JSONL schema of ``traces.py``), e.g. the
                                        run's own rollouts; answers {"accepted": [ids],
                                        "rejected": [{"index": i, "error": "..."}]}
    GET  /v1/pairs?after=C&limit=N      ready pairs with cursor > C (``pairs.Pair`` fields)
    GET  /v1/process_rewards/{trace_id} {"rewards": {turn_index: reward}}

The service binds ``127.0.0.1`` by default. Bound to anything else it refuses to start without
``secret_env``; with a secret, every route but ``/health`` needs ``Authorization: Bearer
<secret>`` (compared in constant time, never logged). A body larger than ``16 *
traces.max_line_bytes`` is refused before it is parsed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request

from prime_composer.config.teacher import TeacherServiceConfig
from prime_composer.inference.auth import serving_secret
from prime_composer.teacher.pairs import PairStore
from prime_composer.teacher.store import TeacherStore
from prime_composer.teacher.traces import TraceError, parse_trace

MAX_PAIRS_PER_REQUEST = 1000


def resolve_secret(host: str, secret_env: str | None) -> str | None:
    """The shared secret requests must carry (None: loopback without a secret); ``ValueError``
    naming ``teacher.secret_env`` when the service would be reachable without one."""
    return serving_secret(host, secret_env, "teacher")


def _auth(secret: str | None) -> Callable[[Request], None]:
    def check(request: Request) -> None:
        if secret is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise HTTPException(401, "missing shared secret: send 'Authorization: Bearer <secret>'")
        if not hmac.compare_digest(token.strip().encode(), secret.encode()):
            raise HTTPException(401, "wrong shared secret")

    return check


def build_app(
    cfg: TeacherServiceConfig, store: TeacherStore, secret: str | None, wake: asyncio.Event | None = None
) -> FastAPI:
    """The routes over ``store`` (used from the service's event loop); ``wake`` is set when traces
    arrive, so an idle replay loop starts on them at once."""
    app = FastAPI(title="prime-composer teacher", docs_url=None, redoc_url=None)
    auth = Depends(_auth(secret))
    pairs = PairStore(cfg.store_path)
    max_body = 16 * cfg.traces.max_line_bytes

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/stats", dependencies=[auth])
    async def stats() -> dict[str, Any]:
        return store.stats()

    @app.post("/v1/traces", dependencies=[auth])
    async def add_traces(request: Request) -> dict[str, Any]:
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
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HTTPException(400, f"the body is not JSON: {e}") from None
        if not isinstance(data, dict) or not isinstance(data.get("traces"), list):
            raise HTTPException(400, 'the body must be {"traces": [trace, ...]}')
        accepted, rejected = [], []
        for i, raw in enumerate(data["traces"]):
            try:
                trace = parse_trace(raw, f"http traces[{i}]", cfg.traces)
            except TraceError as e:
                rejected.append({"index": i, "error": str(e)})
                continue
            conflict = store.add_trace(trace)
            if conflict is not None:
                rejected.append({"index": i, "error": conflict})
            else:
                accepted.append(trace.trace_id)
        if accepted and wake is not None:
            wake.set()
        return {"accepted": accepted, "rejected": rejected}

    @app.get("/v1/pairs", dependencies=[auth])
    async def get_pairs(
        after: int = Query(0, ge=0), limit: int = Query(100, ge=1, le=MAX_PAIRS_PER_REQUEST)
    ) -> dict[str, Any]:
        taken = pairs.take(limit, after_cursor=after)
        return {
            "pairs": [dataclasses.asdict(p) for p in taken],
            "cursor": taken[-1].cursor if taken else after,
        }

    @app.get("/v1/process_rewards/{trace_id}", dependencies=[auth])
    async def process_rewards(trace_id: str) -> dict[str, Any]:
        return {"trace_id": trace_id, "rewards": pairs.process_rewards(trace_id)}

    return app

"""The ``teacher`` process: one store, one replay loop, the HTTP routes, the reference worker.

Start-up: take an exclusive lock on ``<output_dir>/teacher/service.lock`` (two services on one
store would each think they own the budget), open the store, import the configured trace files,
charge the calls a previous process left in flight at their worst case (``settle_orphans``),
rebuild spending from the ledger. Then:

- ``serve = false``: label everything pending, compute reference logprobs, log the stats, exit;
- ``serve = true``: serve the routes (``server.py``) and repeat "label what is pending" until
  SIGTERM/SIGINT (which lets the steps in flight finish and starts no others), waking early when ``POST /v1/traces`` brings new traces; a worker thread turns
  pending pair candidates into ready pairs meanwhile. The event loop of the routes does nothing
  else: the replay loop runs on its own event loop in a thread, POSTed bodies are parsed and stored
  in a worker process (``ingest.py``), so ``/health`` answers at once whatever the load. The bound address is written to
  ``<output_dir>/teacher/service.json`` (``{"url": ...}``; ``port = 0`` picks a free port).

Metrics go to ``<output_dir>/metrics/teacher.jsonl`` after every pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import math
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prime_composer.config.errors import ConfigError
from prime_composer.config.teacher import TeacherServiceConfig
from prime_composer.io import atomic_write_text
from prime_composer.metrics import MetricsLogger
from prime_composer.teacher.budget import Budget
from prime_composer.teacher.ingest import TraceIngestor
from prime_composer.teacher.pool import LIMIT_OUTCOMES, StudentSampler, TeacherPool
from prime_composer.teacher.reference import ReferenceScorer
from prime_composer.teacher.replay import Replayer, import_sources, reference_pass
from prime_composer.teacher.server import build_app, resolve_secret
from prime_composer.teacher.store import TeacherStore

logger = logging.getLogger("prime_composer.teacher")

COUNTED_OUTCOMES = (*LIMIT_OUTCOMES, "budget", "orphaned")


@contextlib.contextmanager
def exclusive_store(store_path: Path) -> Iterator[None]:
    """Hold ``service.lock`` next to the store for the life of the process (released by the kernel
    even on SIGKILL)."""
    lock_path = store_path.parent / "service.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"another teacher process holds {lock_path}: one service per store (stop it, or use "
                "another output_dir)"
            ) from None
        yield


def run_service(cfg: TeacherServiceConfig) -> int:
    try:
        secret = resolve_secret(cfg.host, cfg.secret_env) if cfg.serve else None
    except ValueError as e:
        raise ConfigError(str(e)) from None
    with exclusive_store(cfg.store_path):
        store = TeacherStore(cfg.store_path)
        try:
            try:
                summary = import_sources(cfg, store)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            logger.info("imported %d traces (%d rejected)", summary.num_added, summary.num_rejected)
            asyncio.run(_run(cfg, store, secret))
        finally:
            store.close()
    return 0


def _summary(stats: dict[str, Any]) -> dict[str, float]:
    """The metrics of one pass. ``teacher/agreement_rate`` is the share of valid teacher votes, over
    every labeled step so far, that went to the trace's own action (1: the teachers would have done
    what the policy did; with the cascade, a step where the cheapest teacher agreed counts one vote)."""
    votes = stats["votes"]
    # Calls cut off by a bound, refused for money, or orphaned by a crash, each by kind.
    return {
        "teacher/agreement_rate": votes["for_trace"] / votes["total"] if votes["total"] else 0.0,
        "teacher/votes": votes["total"],
        "teacher/spent_usd": stats["spent_usd"],
        "teacher/calls_paid": stats["calls_paid"],
        "teacher/pairs_ready": stats["pairs"].get("ready", 0),
        "teacher/steps_pair": stats["steps"].get("pair", 0),
        "teacher/steps_confirmed": stats["steps"].get("confirmed", 0),
        "teacher/traces_done": stats["traces"].get("done", 0),
        **{f"teacher/calls_{kind}": stats["calls"].get(kind, 0) for kind in COUNTED_OUTCOMES},
        # The gate's calibration on the labeled steps (teacher/voi.py): labels, ece, brier.
        **{f"teacher/gate_{k}": v for k, v in stats.get("gate", {}).items()},
    }


class _Server:
    """uvicorn without its own signal handling (the service stops it)."""

    def __init__(self, app: Any, sock: socket.socket) -> None:
        import uvicorn

        class Quiet(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

        self.server = Quiet(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.sock = sock

    async def serve(self) -> None:
        await self.server.serve(sockets=[self.sock])

    def stop(self) -> None:
        self.server.should_exit = True


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP: asyncio sets TCP_NODELAY only on connections accepted from such a socket, and
    # without it each kept-alive response waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    # Listening now, before service.json names the address: a client that reads it at once is
    # queued in the backlog, not refused, while uvicorn's task has not started yet.
    sock.listen(2048)
    return sock


async def _wait(event: asyncio.Event, timeout: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout)


async def _run(cfg: TeacherServiceConfig, store: TeacherStore, secret: str | None) -> None:
    num_orphans, orphaned_usd = store.settle_orphans()
    if num_orphans:
        logger.warning(
            "%d teacher calls were in flight when the last process stopped: charged at their reserved "
            "worst case, $%.6f (ledger outcome 'orphaned')",
            num_orphans,
            orphaned_usd,
        )
    budget = Budget(cfg.budget, store.spent_by_trace())
    try:  # an API key variable that is named but not set is the user's to fix
        pool = TeacherPool(
            cfg.pool, cfg.budget, store, budget, expected_output_tokens=cfg.gate.expected_output_tokens
        )
        student = StudentSampler(cfg.pairs.on_policy, cfg.seed) if cfg.pairs.on_policy.enabled else None
    except ValueError as e:
        raise ConfigError(str(e)) from None
    replayer = Replayer(cfg, store, pool, student)
    scorer = ReferenceScorer(cfg.model, cfg.reference)
    reference_store = TeacherStore(cfg.store_path)  # the worker thread's own connection
    metrics = MetricsLogger(cfg.output_dir, "teacher")
    logger.info("run spend so far $%.4f (from the ledger)", budget.spent())
    try:
        if not cfg.serve:
            num = await replayer.run_pending()
            num_ready = await asyncio.to_thread(
                reference_pass, reference_store, scorer, cfg.pairs.max_pair_tokens
            )
            stats = store.stats()
            metrics.log(0, _summary(stats))
            logger.info(
                "labeled %d steps, %d pairs ready; %s", num, num_ready, json.dumps(stats, sort_keys=True)
            )
            return
        await _serve(cfg, store, secret, replayer, scorer, reference_store, metrics)
    finally:
        await pool.aclose()
        if student is not None:
            await student.aclose()
        reference_store.close()


class _ReplayThread:
    """The replay loop on an event loop of its own, in a thread: planning a large trace, its SQLite
    writes and the teachers' answers never hold up the routes (``/health`` included)."""

    def __init__(
        self, cfg: TeacherServiceConfig, store: TeacherStore, replayer: Replayer, metrics: MetricsLogger
    ):
        self.cfg, self.store, self.replayer, self.metrics = cfg, store, replayer, metrics
        self._loop = asyncio.new_event_loop()
        self._stop, self._wake = asyncio.Event(), asyncio.Event()

    def wake(self) -> None:
        """New traces arrived (any thread)."""
        self._call(self._wake.set)

    def stop(self) -> None:
        """Finish the steps in flight (no new ones start), then return from ``run`` (any thread)."""
        self.replayer.stopping.set()
        self._call(self._stop.set)
        self._call(self._wake.set)

    def _call(self, fn: Callable[[], None]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has already finished and closed
            self._loop.call_soon_threadsafe(fn)

    def run(self) -> None:
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self) -> None:
        iteration, labeled_since, logged_at = 0, 0, -math.inf

        def log() -> None:
            nonlocal labeled_since, logged_at
            metrics = {**_summary(self.store.stats()), "teacher/steps_labeled": labeled_since}
            self.metrics.log(iteration, metrics)
            labeled_since, logged_at = 0, time.monotonic()

        try:
            while not self._stop.is_set():
                self._wake.clear()
                labeled = await self.replayer.run_pending()
                iteration += 1
                labeled_since += labeled
                # The summary reads the whole store (the gate's calibration over every label): at
                # most once per metrics_interval_s, or a service woken by every posted batch spends
                # its CPU (on shared cores, the RL step's) on metrics.
                if time.monotonic() - logged_at >= self.cfg.metrics_interval_s:
                    log()
                if labeled == 0:
                    await _wait(self._wake, self.cfg.poll_s)
            log()  # the final counts
        finally:  # the teachers' HTTP clients belong to this loop
            await self.replayer.pool.aclose()
            if self.replayer.student is not None:
                await self.replayer.student.aclose()


async def _serve(
    cfg: TeacherServiceConfig,
    store: TeacherStore,
    secret: str | None,
    replayer: Replayer,
    scorer: ReferenceScorer,
    reference_store: TeacherStore,
    metrics: MetricsLogger,
) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    replay = _ReplayThread(cfg, store, replayer, metrics)

    def request_stop() -> None:
        stop.set()
        replay.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, request_stop)
    sock = _bind(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    ingestor = TraceIngestor(cfg.store_path, cfg.traces)
    app, close_reads = build_app(cfg, secret, ingestor, on_traces=replay.wake)
    server = _Server(app, sock)
    serving = asyncio.create_task(server.serve())
    atomic_write_text(cfg.store_path.parent / "service.json", json.dumps({"url": url}) + "\n")
    logger.info("serving on %s", url)

    async def reference_loop() -> None:
        try:  # loading takes seconds (torch, transformers, the weights): start before any pair
            if cfg.reference.preload:
                await asyncio.to_thread(scorer.load)
        except Exception:  # a model that cannot load is retried by the passes below, and logged
            logger.exception("loading the reference model %s failed", scorer.name)
        while not stop.is_set():
            try:
                ready = await asyncio.to_thread(
                    reference_pass, reference_store, scorer, cfg.pairs.max_pair_tokens
                )
            except Exception:  # the pairs stay pending; the next pass retries them
                logger.exception("reference pass failed; retrying in %.1f s", cfg.poll_s)
                ready = 0
            if ready:
                logger.info("reference logprobs for %d pairs: ready", ready)
            else:
                await _wait(stop, cfg.poll_s)

    referencing = asyncio.create_task(reference_loop())
    replaying = asyncio.create_task(asyncio.to_thread(replay.run))
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({replaying, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        logger.info("stopping")
        request_stop()
        server.stop()
        await asyncio.gather(serving, referencing, stopping, return_exceptions=True)
        sock.close()
        ingestor.close()
        close_reads()
    await replaying  # a replay loop that failed fails the service

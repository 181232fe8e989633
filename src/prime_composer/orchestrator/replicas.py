"""Several inference replicas behind one orchestrator: who serves the next call, who is out.

``ReplicaPool`` keeps, for every server of ``orchestrator.base_url`` (a list), the calls in flight
on it, the weights step it serves and whether it is in the pool. The rules:

- **least in flight**: a call goes to the replica with the fewest calls in flight among those
  that serve the current step (ties: the one that has served fewer calls, then list order);
- **step gating**: the current step is the newest one a replica in the pool has loaded
  (``PolicySync`` sends every update to all of them, ``policy.py``); a replica still on older
  weights gets no call until it has loaded the current ones;
- **taken out**: ``max_failures`` failed calls in a row (connection refused or reset, timeout,
  5xx), or a failed weight update, take a replica out; every ``retry_s`` a background task asks
  its ``/health``, and once it answers the replica is back with the step it reports (the base
  model after a restart), so it serves again after ``PolicySync`` has brought it to the current
  step. Deaths and returns are logged and counted in ``metrics()``.

``ReplicaRouter`` is what rollouts talk to: an HTTP relay on 127.0.0.1 (a free port) that sends
each call on to a replica chosen by the pool and hands its answer back unchanged. A call that
fails on one replica (no answer, a timeout, a 5xx) is sent to another, so a replica killed
mid-run costs its calls a retry, not a rollout; the relay is below verifiers' interception, which
records the call once. Only when no replica is left for ``wait_s`` does a call fail (its rollout
becomes an error sample). Answers are relayed whole (no streaming; rollouts do not stream).

Credentials: with a ``signer`` (the pool's servers have ``inference.secret_env``), the relay drops
the caller's ``Authorization`` header and signs each call it sends on, afresh for each replica it
tries (``wire.auth.Signer``): rollouts (verifiers' OpenAI client, the token client) talk to the
relay on loopback, and what reaches another machine carries no reusable secret. Without a
signer the caller's ``Authorization`` header goes through as it came.

With a single server there is no relay (rollouts call it directly, as before) unless a signer is
set and the server is on another machine. Health probes go through the shared client
(``client.http.EndpointClient``, one attempt each).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from prime_composer.client.http import EndpointClient
from prime_composer.client.tls import InferenceTLS, async_transport
from prime_composer.config.client import RetryConfig
from prime_composer.config.orchestrator import ReplicasConfig
from prime_composer.netaddr import is_loopback, server_root
from prime_composer.wire.auth import Signer

logger = logging.getLogger(__name__)

HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host", "content-length"}
)
"""Headers that describe one connection, not the call: never relayed."""


@dataclass
class Replica:
    """One inference server and what the pool knows of it."""

    index: int
    url: str
    """Server root, ``http://host:port`` (no ``/v1``)."""
    loaded_step: int | None = 0
    """Weights step it serves (0: the base model); None: unknown until it reports it."""
    alive: bool = True
    in_flight: int = 0
    failures_in_a_row: int = 0
    out_since: float = 0.0
    last_probe: float = 0.0
    num_calls: int = 0
    num_failures: int = 0
    num_deaths: int = 0
    last_error: str = ""


class NoReplicaError(RuntimeError):
    """Every replica is out of the pool."""


class ReplicaPool:
    def __init__(
        self,
        urls: list[str],
        config: ReplicasConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        loaded_step: int = 0,
        signer: Signer | None = None,
        tls: InferenceTLS | None = None,
    ) -> None:
        """``signer``: signs the calls the relay sends on (see the module docstring); ``tls``: how
        ``https://`` servers' certificates are checked (``client.tls``; None: the system's CAs)."""
        if not urls:
            raise ValueError("a replica pool needs at least one server URL")
        self.config = config or ReplicasConfig()
        self.clock = clock
        self.urls = list(urls)
        self.replicas = [Replica(i, server_root(u), loaded_step=loaded_step) for i, u in enumerate(urls)]
        self.num_failovers = 0
        """Calls sent again to another replica after one failed."""
        self._changed = asyncio.Event()
        self._probe_task: asyncio.Task[None] | None = None
        self.signer = signer
        self.tls = tls
        self._health: dict[int, EndpointClient] = {}
        self._closing: list[EndpointClient] = []
        self._reported: dict[str, int] = {}

    # ----------------------------------------------------------------------------------- state

    @property
    def step(self) -> int:
        """The current policy step: the newest one a replica in the pool serves (0 if none does)."""
        steps = [r.loaded_step for r in self.replicas if r.alive and r.loaded_step is not None]
        return max(steps, default=0)

    @property
    def alive(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

    def serving(self) -> list[Replica]:
        """Replicas that may take a call now: in the pool and on the current step."""
        step = self.step
        return [r for r in self.replicas if r.alive and r.loaded_step == step]

    def acquire(self, exclude: frozenset[int] = frozenset()) -> Replica | None:
        """The replica for the next call (its in-flight count taken), or None when none serves."""
        candidates = [r for r in self.serving() if r.index not in exclude]
        if not candidates:
            return None
        replica = min(candidates, key=lambda r: (r.in_flight, r.num_calls, r.index))
        replica.in_flight += 1
        replica.num_calls += 1
        return replica

    def release(self, replica: Replica, error: str | None = None) -> None:
        """End a call acquired from the pool; ``error`` says why it failed (None: it succeeded)."""
        replica.in_flight -= 1
        if error is None:
            replica.failures_in_a_row = 0
        else:
            self.record_failure(replica, error)
        self._changed.set()

    def record_failure(self, replica: Replica, error: str, *, fatal: bool = False) -> None:
        """One failed call (``fatal``: one that takes the replica out at once)."""
        replica.num_failures += 1
        replica.failures_in_a_row += 1
        replica.last_error = error
        if replica.alive and (fatal or replica.failures_in_a_row >= self.config.max_failures):
            replica.alive = False
            replica.num_deaths += 1
            replica.out_since = replica.last_probe = self.clock()
            left = len(self.alive)
            logger.warning(
                "inference replica %d (%s) taken out after %d failure(s) (%s); %d of %d left, retried every %.0f s",
                replica.index,
                replica.url,
                replica.failures_in_a_row,
                error,
                left,
                len(self.replicas),
                self.config.retry_s,
            )
        self._changed.set()

    def mark_loaded(self, replica: Replica, step: int) -> None:
        replica.loaded_step = step
        self._changed.set()

    def revive(self, replica: Replica, step: int | None) -> None:
        """Back in the pool, serving ``step`` (what its ``/health`` reports)."""
        replica.alive = True
        replica.failures_in_a_row = 0
        replica.loaded_step = step
        logger.warning(
            "inference replica %d (%s) is back (out for %.0f s), serving step %s; it takes calls once it "
            "runs the current weights",
            replica.index,
            replica.url,
            self.clock() - replica.out_since,
            step,
        )
        self._changed.set()

    async def wait_serving(self, exclude: frozenset[int] = frozenset()) -> Replica | None:
        """Like ``acquire``, but waits up to ``wait_s`` for a replica to serve."""
        deadline = time.monotonic() + self.config.wait_s
        while (replica := self.acquire(exclude)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (exclude and self.serving()):
                return None  # the ones left were tried already: fail this call now
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(remaining, 0.5)):
                    await self._changed.wait()
        return replica

    # ---------------------------------------------------------------------------------- probes

    async def probe_due(self) -> None:
        """Ask the ``/health`` of every replica that is out and was last asked ``retry_s`` ago."""
        now = self.clock()
        due = [r for r in self.replicas if not r.alive and now - r.last_probe >= self.config.retry_s]
        await asyncio.gather(*(self._probe(r) for r in due))

    async def _probe(self, replica: Replica) -> None:
        replica.last_probe = self.clock()
        result = await self._health_client(replica, 5.0).get_json("/health")
        if result.status != 200:
            return
        try:
            reported = result.data["weights"]["step"]
        except (KeyError, TypeError):
            reported = 0  # a server that reports no weights serves what it started with
        self.revive(replica, reported if isinstance(reported, int) else 0)

    async def any_answers(self, timeout_s: float = 5.0) -> bool:
        """Whether at least one replica's ``/health`` answers 200 now (alive or out): the test
        of whether a step's failed rollouts are the data's or the servers' fault."""

        async def answers(replica: Replica) -> bool:
            result = await self._health_client(replica, timeout_s).get_json("/health")
            return result.status == 200

        return any(await asyncio.gather(*(answers(r) for r in self.replicas)))

    def _health_client(self, replica: Replica, timeout_s: float) -> EndpointClient:
        """One attempt within ``timeout_s``: a probe that fails is asked again at the next probe."""
        client = self._health.get(replica.index)
        if client is None or client.retry.timeout_s != timeout_s:
            retry = RetryConfig(timeout_s=timeout_s, max_retries=0)
            client = EndpointClient(replica.url, retry=retry, tls=self.tls)
            old, self._health[replica.index] = self._health.get(replica.index), client
            if old is not None:
                self._closing.append(old)
        return client

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.config.retry_s))
            await self.probe_due()

    async def __aenter__(self) -> ReplicaPool:
        if len(self.replicas) > 1:
            self._probe_task = asyncio.create_task(self._probe_loop(), name="replica-probes")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe_task
            self._probe_task = None
        for client in [*self._health.values(), *self._closing]:
            await client.aclose()
        self._health.clear()
        self._closing.clear()

    # --------------------------------------------------------------------------------- metrics

    def metrics(self) -> dict[str, float]:
        """``replicas/*``: how many serve, how many are out, deaths, failovers, calls per replica
        since the last call of ``metrics``."""
        out: dict[str, float] = {
            "replicas/alive": len(self.alive),
            "replicas/out": len(self.replicas) - len(self.alive),
            "replicas/deaths": sum(r.num_deaths for r in self.replicas),
            "replicas/failovers": self.num_failovers,
        }
        for r in self.replicas:
            key = f"replicas/{r.index}/calls"
            out[key] = r.num_calls - self._reported.get(key, 0)
            self._reported[key] = r.num_calls
        return out


class ReplicaRouter:
    """The HTTP relay rollouts call instead of one server (see the module docstring).

    ``async with ReplicaRouter(pool) as base_url:`` gives ``http://127.0.0.1:<port>/v1``.
    """

    def __init__(self, pool: ReplicaPool) -> None:
        self.pool = pool
        self._http: httpx.AsyncClient | None = None
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> str:
        import uvicorn

        class Quiet(uvicorn.Server):  # the orchestrator handles signals, not the relay
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        timeout = self.pool.config.request_timeout_s
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=10.0),
            limits=limits,
            transport=async_transport(self.pool.tls, limits),
        )
        # Idle connections stay open longer than the callers' pools keep them (httpx: 5 s).
        self._server = Quiet(uvicorn.Config(self, log_level="warning", lifespan="off", timeout_keep_alive=75))
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="replica-router")
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the replica relay did not start")
            await asyncio.sleep(0.01)
        logger.info(
            "relaying rollouts on 127.0.0.1:%d to %d inference replicas: %s",
            port,
            len(self.pool.replicas),
            ", ".join(r.url for r in self.pool.replicas),
        )
        return f"http://127.0.0.1:{port}/v1"

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(self._task, 10)
        if self._http is not None:
            await self._http.aclose()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = bytearray()
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"] + (f"?{scope['query_string'].decode()}" if scope.get("query_string") else "")
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in scope["headers"]
            if k.decode("latin-1").lower() not in HOP_HEADERS
        ]
        status, out_headers, content = await self.relay(scope["method"], path, headers, bytes(body))
        await send({"type": "http.response.start", "status": status, "headers": out_headers})
        await send({"type": "http.response.body", "body": content})

    async def relay(
        self, method: str, path: str, headers: list[tuple[str, str]], body: bytes
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """Send one call to a replica, and to another while it fails; the answer to hand back."""
        assert self._http is not None
        tried: set[int] = set()
        last: tuple[int, list[tuple[bytes, bytes]], bytes] | None = None
        error = ""
        while True:
            replica = await self.pool.wait_serving(frozenset(tried))
            if replica is None:
                if last is not None:
                    return last
                if self.pool.serving():  # every replica that serves was tried and gave no answer
                    message = f"the call failed on every inference replica that serves ({error})"
                    return 502, [(b"content-type", b"application/json")], _error_json(message, 502)
                message = (
                    f"no inference replica serves the current weights (step {self.pool.step}); "
                    f"{len(self.pool.alive)} of {len(self.pool.replicas)} in the pool"
                )
                return 503, [(b"content-type", b"application/json")], _error_json(message, 503)
            if tried:
                self.pool.num_failovers += 1
            tried.add(replica.index)
            url = replica.url + path
            sent = headers
            if self.pool.signer is not None:
                sent = [(k, v) for k, v in headers if k.lower() != "authorization"]
                sent += list(self.pool.signer.headers(method, url, body).items())
            try:
                response = await self._http.request(method, url, headers=sent, content=body)
            except httpx.HTTPError as e:
                error = f"{type(e).__name__}: {e}"
                self.pool.release(replica, error)
                continue
            except BaseException:
                self.pool.release(replica)
                raise
            out_headers = [
                (k.encode("latin-1"), v.encode("latin-1"))
                for k, v in response.headers.items()
                if k.lower() not in HOP_HEADERS and k.lower() != "content-encoding"
            ]
            content = response.content
            out_headers.append((b"content-length", str(len(content)).encode()))
            answer = (response.status_code, out_headers, content)
            if response.status_code >= 500:
                self.pool.release(replica, f"HTTP {response.status_code}")
                last = answer
                continue
            self.pool.release(replica)
            return answer


def _error_json(message: str, code: int) -> bytes:
    return json.dumps({"error": {"message": message, "type": "no_replica", "code": code}}).encode()


@contextlib.asynccontextmanager
async def rollout_url(pool: ReplicaPool) -> AsyncIterator[str]:
    """The base URL rollouts use: the server itself with one replica (on this machine, or with no
    signer), the relay with several, with a signer and a server on another machine, or with a pinned
    certificate or CA (``tls``: the rollouts' own client would not check it)."""
    remote = any(not is_loopback(httpx.URL(r.url).host) for r in pool.replicas)
    if len(pool.replicas) == 1 and not (pool.signer is not None and remote) and pool.tls is None:
        yield pool.urls[0]
        return
    async with ReplicaRouter(pool) as url:
        yield url

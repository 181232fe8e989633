"""One client for OpenAI-compatible (and our own admin) HTTP endpoints.

Every call that leaves a process for an endpoint it does not own goes through ``EndpointClient``:
SDPO hint LLMs, weight-update calls to the inference server, replica health probes. It gives them
the same behaviour:

- a time limit per attempt (``RetryConfig.timeout_s``);
- bounded retries with exponential backoff and full jitter on rate limits (429), server errors
  (5xx), timeouts and connection errors, honouring ``Retry-After`` up to ``max_backoff_s``; other
  4xx answers are the request's fault and are never retried;
- at most ``max_concurrency`` calls in flight;
- **errors as data**: a call never raises for a network or HTTP failure; it returns a
  ``CallResult`` with ``ok = False``, an ``error_kind`` (``timeout``, ``connection``, ``http_429``,
  ``http_500``, ..., ``bad_json``, ``bad_response``) and a message, the number of attempts and
  the latency. The caller decides whether that is fatal (a weight update) or a data point (a
  teacher's answer). Only cancellation propagates.

Secrets: the API key is read from the environment variable the config names, sent as a bearer
token, and never appears in logs or error messages (URLs are logged without user info). Our own
inference servers get a ``signer`` instead (``wire.auth.Signer``): every attempt is signed afresh
(method, path, body digest, audience, timestamp, nonce), so no reusable secret crosses the wire
and a retry is not refused as a replay.

What does not use it: the rollout harness's raw token path (``orchestrator/harness.py``). Those
calls go to verifiers' per-rollout interception endpoint with vLLM's extra fields
(``return_token_ids``) and must not be retried here: the interception records every call as a
turn of the trace, so a transparent retry would record one turn twice. The harness fails the
rollout instead, which is recorded as an error sample. (Its ``Authorization`` header carries
verifiers' per-rollout interception secret to a loopback server, not the inference secret.)
Nor do the replica relay's forwarded calls (``orchestrator/replicas.py``: raw bytes and headers
relayed as they came, its own failover across replicas; its health probes do use this client),
nor the links between machines (``wire/fetch.py``: synchronous, a byte cap and a wall-clock
deadline for the whole download, and a layer below this one), nor the teacher service's calls
(``teacher/calls.py``: the reply is capped while it is read, and each attempt says whether the
provider may have billed it; they reuse this module's retry statuses).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from prime_composer.client.tls import InferenceTLS, async_transport
from prime_composer.config.client import RetryConfig
from prime_composer.wire.auth import Signer

logger = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
"""HTTP statuses worth another attempt (the server may answer differently later)."""


@dataclass(frozen=True)
class CallResult:
    """What one call (all its attempts) came to."""

    ok: bool
    """A 2xx answer whose body parsed (and, for ``chat_completion``, had a message)."""
    status: int | None
    """HTTP status of the last attempt; None when no answer arrived (timeout, connection)."""
    data: Any
    """Parsed JSON body of the last answer (also on an error answer, when it was JSON)."""
    error: str | None
    """``"<kind>: <message>"`` when not ok; never contains secrets."""
    error_kind: str | None
    """``timeout`` | ``connection`` | ``http_<status>`` | ``bad_json`` | ``bad_response``."""
    attempts: int
    latency_s: float
    """Wall time of the whole call, backoff waits included."""

    def raise_for_error(self, what: str) -> Any:
        """``data`` when ok, else ``CallError`` naming ``what`` failed and why."""
        if not self.ok:
            raise CallError(f"{what} failed after {self.attempts} attempt(s): {self.error}", self)
        return self.data


class CallError(RuntimeError):
    """A call whose failure the caller cannot record as data (e.g. a weight update)."""

    def __init__(self, message: str, result: CallResult) -> None:
        super().__init__(message)
        self.result = result


def read_api_key(api_key_env: str | None, config_key: str) -> str | None:
    """The key in ``$api_key_env`` (None when no variable is named); a named but unset variable is
    a ``ValueError`` naming ``config_key``, the config field that named it."""
    if api_key_env is None:
        return None
    key = os.environ.get(api_key_env)
    if not key:
        raise ValueError(
            f"{config_key} names the environment variable {api_key_env!r}, which is not set: export it, "
            f"or set {config_key} to none for an endpoint without a key"
        )
    return key


def redact_url(url: str) -> str:
    """``url`` without user info (``https://user:pw@host`` -> ``https://host``), for logs."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError):
        return "<invalid url>"
    return str(parsed.copy_with(username=None, password=None)) if parsed.userinfo else url


class EndpointClient:
    """Calls one endpoint (``base_url``, e.g. ``http://127.0.0.1:8000/v1``) with the rules above.

    Use as ``async with EndpointClient(...) as client`` or call ``aclose()``; the underlying
    connection pool is created on first use inside the running event loop.
    """

    def __init__(
        self,
        base_url: str,
        *,
        retry: RetryConfig | None = None,
        api_key: str | None = None,
        signer: Signer | None = None,
        headers: dict[str, str] | None = None,
        max_concurrency: int | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        tls: InferenceTLS | None = None,
    ) -> None:
        """``api_key`` (see ``read_api_key``) is sent as ``Authorization: Bearer``; ``signer`` signs
        each attempt instead (one or the other); ``tls``: how an ``https://`` server's certificate is
        checked (``client.tls``: a pinned fingerprint or a CA; None: the system's CAs); ``sleep``,
        ``rng`` and ``transport`` are for tests (fake time, fixed jitter, an in-process server)."""
        if api_key and signer is not None:
            raise ValueError("EndpointClient: give an api_key or a signer, not both")
        self.base_url = base_url.rstrip("/")
        self.retry = retry or RetryConfig()
        self._headers = dict(headers or {})
        self._signer = signer
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._max_concurrency = max_concurrency
        self._semaphore: asyncio.Semaphore | None = None
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._transport = transport
        self._tls = tls
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __aenter__(self) -> EndpointClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _http(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is not None and self._loop is not loop:
            # A pool belongs to the loop that made it; a new loop (a later asyncio.run) gets its own.
            self._client = None
        if self._client is None:
            self._loop = loop
            self._semaphore = asyncio.Semaphore(self._max_concurrency) if self._max_concurrency else None
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            transport = self._transport
            if transport is None and self._tls is not None:
                transport = async_transport(self._tls, limits)
            self._client = httpx.AsyncClient(timeout=self.retry.timeout_s, transport=transport, limits=limits)
        return self._client

    # ------------------------------------------------------------------------------------- calls

    async def post_json(self, path: str, body: dict[str, Any]) -> CallResult:
        """POST ``body`` as JSON to ``base_url + path``."""
        return await self._call("POST", path, body)

    async def get_json(self, path: str) -> CallResult:
        """GET ``base_url + path``."""
        return await self._call("GET", path, None)

    async def chat_completion(self, body: dict[str, Any]) -> CallResult:
        """POST ``/chat/completions`` (non-streaming); ok only if ``choices[0].message`` is there."""
        result = await self.post_json("/chat/completions", {**body, "stream": False})
        if result.ok and not _has_message(result.data):
            return _replace(result, ok=False, error_kind="bad_response", message="no choices[0].message")
        return result

    async def _call(self, method: str, path: str, body: dict[str, Any] | None) -> CallResult:
        self._http()  # binds pool and semaphore to the running loop
        if self._semaphore is None:
            return await self._attempts(method, path, body)
        async with self._semaphore:
            return await self._attempts(method, path, body)

    async def _attempts(self, method: str, path: str, body: dict[str, Any] | None) -> CallResult:
        url = f"{self.base_url}{path}"
        started = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            status, data, kind, message, retry_after = await self._once(method, url, body)
            retryable = kind in ("timeout", "connection") or (status is not None and status in RETRY_STATUSES)
            if kind is None or not retryable or attempt > self.retry.max_retries:
                return CallResult(
                    ok=kind is None,
                    status=status,
                    data=data,
                    error=None if kind is None else f"{kind}: {message}",
                    error_kind=kind,
                    attempts=attempt,
                    latency_s=time.monotonic() - started,
                )
            wait = self._backoff(attempt, retry_after)
            logger.info(
                "%s %s: %s (attempt %d of %d), retrying in %.2f s",
                method,
                redact_url(url),
                kind,
                attempt,
                self.retry.max_retries + 1,
                wait,
            )
            await self._sleep(wait)

    async def _once(
        self, method: str, url: str, body: dict[str, Any] | None
    ) -> tuple[int | None, Any, str | None, str, float | None]:
        """One attempt: ``(status, data, error kind or None, message, Retry-After seconds)``."""
        try:
            # httpx's timeout bounds each read; the attempt as a whole (a server that trickles
            # its answer) is bounded by the wall clock.
            async with asyncio.timeout(self.retry.timeout_s):
                response = await self._send(method, url, body)
        except (httpx.TimeoutException, TimeoutError) as e:
            return (
                None,
                None,
                "timeout",
                f"no answer within {self.retry.timeout_s} s ({type(e).__name__})",
                None,
            )
        except httpx.HTTPError as e:  # connection refused/reset, protocol errors
            return None, None, "connection", f"{type(e).__name__}: {e}", None
        try:
            data = response.json() if response.content else None
            parsed = True
        except (json.JSONDecodeError, UnicodeDecodeError):
            data, parsed = None, False
        status = response.status_code
        if not 200 <= status < 300:
            detail = response.text[:300] if not parsed else json.dumps(data)[:300]
            return status, data, f"http_{status}", detail, _retry_after(response)
        if not parsed:
            return status, None, "bad_json", f"the answer is not JSON: {response.text[:200]!r}", None
        return status, data, None, "", None

    async def _send(self, method: str, url: str, body: dict[str, Any] | None) -> httpx.Response:
        if self._signer is None:
            return await self._http().request(method, url, json=body, headers=self._headers)
        content = b"" if body is None else json.dumps(body).encode()
        headers = {**self._headers, **self._signer.headers(method, url, content)}
        if body is not None:
            headers["Content-Type"] = "application/json"
        return await self._http().request(method, url, content=content, headers=headers)

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        cap = min(self.retry.max_backoff_s, self.retry.backoff_s * 2 ** (attempt - 1))
        wait = self._rng.uniform(0, cap)
        if retry_after is not None:
            wait = max(wait, min(retry_after, self.retry.max_backoff_s))
        return wait


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:  # an HTTP date: fall back to our own backoff
        return None


def _has_message(data: Any) -> bool:
    try:
        return isinstance(data["choices"][0]["message"], dict)
    except (KeyError, IndexError, TypeError):
        return False


def _replace(result: CallResult, *, ok: bool, error_kind: str, message: str) -> CallResult:
    return CallResult(
        ok=ok,
        status=result.status,
        data=result.data,
        error=f"{error_kind}: {message}",
        error_kind=error_kind,
        attempts=result.attempts,
        latency_s=result.latency_s,
    )

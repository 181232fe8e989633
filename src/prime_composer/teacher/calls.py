"""One bounded attempt at a teacher's ``/chat/completions``: a wall-clock limit, a size cap while
reading, and whether the provider may have billed it.

``EndpointClient`` (``client/http.py``) reads the whole body before it parses it and knows nothing
of billing: a 20 MB reply would be read (and cached) whole, and an attempt cut off mid-answer would
look like one that never reached the provider. The pool asks teachers through ``TeacherCaller``
instead (the same retry statuses and full-jitter backoff, limits from each teacher's ``retry``):

- the attempt runs under one deadline, ``min(retry.timeout_s, the step's deadline)``, connecting,
  sending and reading included (outcome ``timeout`` for the attempt's limit, ``step_deadline`` for
  the step's);
- the body is read in chunks and cut off once it passes ``max_reply_bytes`` (outcome
  ``too_large``); a declared ``Content-Length`` above the cap is refused before reading;
- the parsed answer's ``usage.completion_tokens`` above the ``max_tokens`` the request asked for is
  ``too_many_tokens`` (a provider that ignored the limit; its reported cost is still recorded);
- errors are data (``Attempt.kind``), as in ``EndpointClient``; only cancellation propagates.

``Attempt.billable`` says whether the provider may have charged for an attempt that gave no usage:
once the request's first bytes went out (httpcore's ``trace`` extension says when) it may be
generating, so the pool charges such an attempt its reserved worst case unless it answered with an
HTTP error status; an attempt cut off while still connecting costs nothing.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from prime_composer.client.http import RETRY_STATUSES

RETRYABLE_KINDS = frozenset({"timeout", "connection"})


@dataclass(frozen=True)
class Attempt:
    """What one attempt came to."""

    status: int | None
    data: Any
    """Parsed JSON body (also of an error answer, when it was JSON)."""
    kind: str | None
    """None when ok; ``timeout`` | ``step_deadline`` | ``connection`` | ``http_<status>`` |
    ``bad_json`` | ``bad_response`` | ``too_large`` | ``too_many_tokens``."""
    message: str
    retry_after: float | None
    sent: bool
    """The request may have reached the provider (it may be generating, and may bill)."""
    num_bytes: int
    """Body bytes read."""
    seconds: float

    @property
    def ok(self) -> bool:
        return self.kind is None

    @property
    def retryable(self) -> bool:
        return self.kind in RETRYABLE_KINDS or (
            self.kind is not None and self.kind.startswith("http_") and self.status in RETRY_STATUSES
        )

    @property
    def billable(self) -> bool:
        """Whether the provider may have billed it (an HTTP error status is taken as not billed
        unless it reported usage)."""
        return self.sent and not (self.status is not None and not 200 <= self.status < 300)


@dataclass
class _Progress:
    """How far an attempt got (read when its deadline cuts it off)."""

    status: int | None = None
    num_bytes: int = 0
    sent: bool = False
    """The request's first bytes went out (httpcore's trace): from then on it may be billed."""

    async def trace(self, name: str, info: dict[str, Any]) -> None:
        if name.endswith("send_request_headers.started"):
            self.sent = True


class TeacherCaller:
    """Attempts against one teacher endpoint (``base_url`` up to ``/v1``), at most
    ``max_concurrency`` in flight (``slot()``)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None,
        max_concurrency: int,
        max_reply_bytes: int,
        rng: random.Random | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.max_concurrency = max_concurrency
        self.max_reply_bytes = max_reply_bytes
        self.rng = rng or random.Random()
        self._client: httpx.AsyncClient | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _bind(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:  # a pool belongs to the loop that made it
            self._loop = loop
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
            # No httpx timeout: the attempt's deadline below bounds everything, reads included.
            self._client = httpx.AsyncClient(
                timeout=None, limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)
            )
        return self._client

    def slot(self) -> asyncio.Semaphore:
        self._bind()
        assert self._semaphore is not None
        return self._semaphore

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def attempt(
        self, body: dict[str, Any], attempt_s: float, step_deadline: float, *, completion: bool = False
    ) -> Attempt:
        """POST ``body`` once to ``/chat/completions`` (``/completions`` with ``completion``: a
        prompt of token ids), bounded by ``attempt_s`` seconds and the monotonic ``step_deadline``."""
        client = self._bind()
        started = time.monotonic()
        left = step_deadline - started
        limit, kind_on_limit = (attempt_s, "timeout") if attempt_s <= left else (left, "step_deadline")
        if limit <= 0:
            return Attempt(None, None, "step_deadline", "the step's time ran out", None, False, 0, 0.0)
        state = _Progress()
        try:
            async with asyncio.timeout(limit):
                return await self._read(client, body, started, state, completion)
        except TimeoutError:
            return Attempt(
                state.status, None, kind_on_limit,
                f"no whole answer within {limit:.2f} s ({state.num_bytes} bytes read)",
                None, state.sent, state.num_bytes, time.monotonic() - started,
            )  # fmt: skip
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            return Attempt(
                None,
                None,
                "connection",
                f"{type(e).__name__}: {e}",
                None,
                False,
                0,
                time.monotonic() - started,
            )
        except httpx.HTTPError as e:  # reset or closed mid-answer: the request was sent
            return Attempt(
                state.status, None, "connection", f"{type(e).__name__}: {e}", None, state.sent,
                state.num_bytes, time.monotonic() - started,
            )  # fmt: skip

    async def _read(
        self,
        client: httpx.AsyncClient,
        body: dict[str, Any],
        started: float,
        state: _Progress,
        completion: bool,
    ) -> Attempt:
        cap = self.max_reply_bytes
        url = self.base_url + ("/completions" if completion else "/chat/completions")
        async with client.stream(
            "POST", url, json=body, headers=self._headers, extensions={"trace": state.trace}
        ) as response:
            state.status = status = response.status_code

            def done(kind: str | None, message: str, data: Any = None) -> Attempt:
                retry_after = (
                    _retry_after(response) if kind is not None and kind.startswith("http_") else None
                )
                return Attempt(
                    status,
                    data,
                    kind,
                    message,
                    retry_after,
                    True,
                    state.num_bytes,
                    time.monotonic() - started,
                )

            declared = response.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > cap:
                return done(
                    "too_large", f"the answer declares {declared} bytes, more than max_reply_bytes = {cap}"
                )
            chunks = bytearray()
            async for chunk in response.aiter_bytes():
                chunks += chunk
                state.num_bytes = len(chunks)
                if len(chunks) > cap:
                    return done(
                        "too_large",
                        f"the answer passed max_reply_bytes = {cap} while being read ({len(chunks)} bytes read)",
                    )
        try:
            data = json.loads(chunks) if chunks else None
            parsed = True
        except (json.JSONDecodeError, UnicodeDecodeError):
            data, parsed = None, False
        if not 200 <= status < 300:
            detail = json.dumps(data)[:300] if parsed else bytes(chunks[:300]).decode("utf-8", "replace")
            return done(f"http_{status}", detail, data)
        if not parsed:
            return done("bad_json", f"the answer is not JSON: {bytes(chunks[:200])!r}")
        if not (_has_text(data) if completion else _has_message(data)):
            return done("bad_response", f"no choices[0].{'text' if completion else 'message'}", data)
        reported = _completion_tokens(data)
        if reported is not None and reported > int(body.get("max_tokens") or reported):
            return done(
                "too_many_tokens",
                f"usage reports {reported} completion tokens, more than the max_tokens = {body['max_tokens']} asked",
                data,
            )
        return done(None, "", data)

    def backoff(self, attempt: int, retry_after: float | None, base_s: float, max_s: float) -> float:
        """Full-jitter exponential backoff, at least ``Retry-After`` (both capped at ``max_s``)."""
        wait = self.rng.uniform(0, min(max_s, base_s * 2 ** (attempt - 1)))
        if retry_after is not None:
            wait = max(wait, min(retry_after, max_s))
        return wait


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _has_message(data: Any) -> bool:
    try:
        return isinstance(data["choices"][0]["message"], dict)
    except (KeyError, IndexError, TypeError):
        return False


def _has_text(data: Any) -> bool:
    try:
        return isinstance(data["choices"][0]["text"], str)
    except (KeyError, IndexError, TypeError):
        return False


def _completion_tokens(data: Any) -> int | None:
    try:
        return int(data["usage"]["completion_tokens"])
    except (KeyError, TypeError, ValueError):
        return None

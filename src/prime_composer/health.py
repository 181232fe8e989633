"""Waiting for a server's health endpoint (stdlib only): one poll loop for every process that
starts a server and must not go on before it answers (the launcher, ``eval``, the vLLM backend).

Usage::

    waited = wait_healthy(url, timeout_s=600, give_up=lambda: "exited" if child.poll() else None)
    if not waited.healthy:
        raise RuntimeError(waited.reason or f"no answer from {url} within 600 s")

A poll is one ``GET`` bounded by ``request_timeout_s``; anything but a 200 (refused, reset, an
error status, a half-written reply) means "not yet". ``give_up`` is asked before every poll and
ends the wait with its reason (the process died, a signal came).
"""

from __future__ import annotations

import http.client
import ssl
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Waited:
    """How a wait ended."""

    healthy: bool
    elapsed_s: float
    reason: str | None = None
    """Why it gave up (``give_up``'s answer); ``None`` when healthy or when time ran out."""
    body: bytes = b""
    """The healthy answer's body."""


def poll_health(
    url: str, request_timeout_s: float = 2.0, context: ssl.SSLContext | None = None
) -> bytes | None:
    """The body of ``GET url`` if it answers 200 within ``request_timeout_s``, else ``None``
    (``context``: how an ``https://`` server's certificate is checked; None: the system's CAs)."""
    try:
        with urllib.request.urlopen(url, timeout=request_timeout_s, context=context) as response:
            return bytes(response.read()) if response.status == 200 else None
    except (OSError, http.client.HTTPException):  # refused, reset, timed out, an error status
        return None


def wait_healthy(
    url: str,
    timeout_s: float,
    *,
    poll_s: float = 1.0,
    request_timeout_s: float = 2.0,
    give_up: Callable[[], str | None] | None = None,
    context: ssl.SSLContext | None = None,
) -> Waited:
    """Poll ``url`` until it answers 200, ``give_up`` returns a reason, or ``timeout_s`` passes."""
    start = time.monotonic()
    while True:
        if give_up is not None and (reason := give_up()) is not None:
            return Waited(False, time.monotonic() - start, reason)
        body = poll_health(url, request_timeout_s, context)
        if body is not None:
            return Waited(True, time.monotonic() - start, body=body)
        if time.monotonic() - start > timeout_s:
            return Waited(False, time.monotonic() - start)
        time.sleep(poll_s)

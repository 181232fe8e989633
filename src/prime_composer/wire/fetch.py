"""One HTTP(S) request to another DC, bounded in time and size, signed, and pinned.

``request()`` is what the shardcast downloader (and the relay) use instead of ``httpx``:

- **a wall-clock deadline for the whole attempt.** Socket timeouts (httpx's included) bound each
  read, so a peer that trickles a byte per second never trips them; here a watchdog shuts the
  socket down at the deadline whatever phase the request is in (connect, TLS handshake, headers,
  body), and each read waits at most the time left;
- **a byte cap**: a ``Content-Length`` above ``max_bytes`` is refused before the body is read,
  and a body that grows past it (chunked, or lying) is cut off there;
- **per-request authentication** (``auth.sign_request``): the secret is never sent;
- **certificate pinning** for ``https://`` (``tls.check_pin``), checked after the handshake and
  before the request is written.

Failures raise ``TransportError`` with the reason (``deadline``, ``too_large``, ``pin``,
``connect``, ...); the store turns them into ``None``.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from prime_composer.wire.auth import AUTH_HEADER, sign_request
from prime_composer.wire.tls import PinError, check_pin, client_context

_READ_CHUNK = 1 << 16


class TransportError(Exception):
    """A request that did not complete; ``reason`` is a short machine-readable word."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class Peer:
    """How to reach one server: its base URL, the name it verifies requests against (its cluster
    id), the pinned fingerprint of its certificate (``https://`` only) and the request key."""

    url: str
    audience: str
    key: bytes | None
    fingerprint: str | None = None


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, host: str, port: int | None, timeout: float, fingerprint: str) -> None:
        super().__init__(host, port, timeout=timeout, context=client_context())
        self._fingerprint = fingerprint

    def connect(self) -> None:
        super().connect()
        assert isinstance(self.sock, ssl.SSLSocket)
        try:
            check_pin(self.sock, self._fingerprint, f"https://{self.host}:{self.port}")
        except PinError:
            self.sock.close()
            raise


def _kill(conn: http.client.HTTPConnection) -> None:
    sock = conn.sock
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def request(
    peer: Peer,
    method: str,
    path: str,
    deadline: float,
    max_bytes: int,
    body: bytes = b"",
    sink: Callable[[bytes], None] | None = None,
) -> tuple[int, bytes]:
    """``(status, body)`` of ``method path`` on ``peer`` finished before ``deadline``
    (``time.monotonic()``) with a body of at most ``max_bytes``; ``TransportError`` otherwise.

    ``sink``: a 200 answer's body is handed to it chunk by chunk as it arrives (and ``body`` comes
    back empty), so a large file is never whole in memory; other answers are returned whole."""
    parts = urlsplit(peer.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TransportError("url", f"{peer.url!r} is not an http(s) URL")
    full_path = (parts.path.rstrip("/") + "/" + path.lstrip("/")) if path else parts.path or "/"
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TransportError("deadline", "no time left")
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        if peer.fingerprint is None:
            raise TransportError("pin", f"{peer.url} is https but no fingerprint is pinned for it")
        conn = _PinnedHTTPSConnection(parts.hostname, parts.port, remaining, peer.fingerprint)
    else:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=remaining)
    watchdog = threading.Timer(remaining, _kill, args=(conn,))
    watchdog.daemon = True
    watchdog.start()
    try:
        headers = {"Content-Length": str(len(body))} if body or method != "GET" else {}
        if peer.key is not None:
            headers[AUTH_HEADER] = sign_request(peer.key, method, full_path, body, peer.audience)
        conn.request(method, full_path, body=body or None, headers=headers)
        response = conn.getresponse()
        length = response.getheader("Content-Length")
        if length is not None and length.isdigit() and int(length) > max_bytes:
            raise TransportError(
                "too_large", f"{peer.url}{path} announces {length} bytes, the cap is {max_bytes}"
            )
        chunks, total = [], 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportError("deadline", f"{peer.url}{path} did not finish in time")
            if conn.sock is not None:
                conn.sock.settimeout(left)
            chunk = response.read1(_READ_CHUNK)
            if not chunk:
                break
            total += len(chunk)
            if total > max_bytes:
                raise TransportError("too_large", f"{peer.url}{path} sent over {max_bytes} bytes")
            if sink is not None and response.status == 200:
                sink(chunk)
            else:
                chunks.append(chunk)
        if time.monotonic() > deadline:
            raise TransportError("deadline", f"{peer.url}{path} did not finish in time")
        if length is not None and length.isdigit() and int(length) != total:
            raise TransportError("short", f"{peer.url}{path} sent {total} of {length} bytes")
        return response.status, b"".join(chunks)
    except PinError as e:
        raise TransportError("pin", str(e)) from None
    except TransportError:
        raise
    except (OSError, http.client.HTTPException, ValueError) as e:
        reason = "deadline" if time.monotonic() >= deadline else "connect"
        raise TransportError(reason, f"{peer.url}{path}: {type(e).__name__}: {e}") from None
    finally:
        watchdog.cancel()
        conn.close()

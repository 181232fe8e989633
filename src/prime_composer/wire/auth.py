"""Per-request authentication between DCs: nothing reusable ever crosses the wire.

Every request but ``/health`` carries ``X-Diloco-Auth: v1 aud=<cluster> ts=<unix s>
nonce=<32 hex> sig=<64 hex>`` where::

    key = HKDF-SHA256(secret, salt = b"", info = TRANSPORT_LABEL)          (32 bytes)
    sig = HMAC-SHA256(key, "v1\\n" METHOD "\\n" path "\\n" sha256(body) "\\n" aud "\\n" ts "\\n" nonce)

The transport key is derived from the run's secret with a label of its own, so it differs from
the payload-signing key (``payload.py`` signs with the secret itself): seeing a request reveals
neither. A receiver (``Verifier``) refuses a request whose signature does not cover exactly its
method, path (with query) and body, whose audience is another server (a request captured on the
way to one DC cannot be replayed to another), whose timestamp is more than ``window_s`` away
from its own clock, or whose nonce it has already seen within that window (nonces are
remembered for ``2 * window_s``, so a replay inside the window is refused and one outside it is
refused by its timestamp).

The inference server's routes use the same scheme under their own header (``INFERENCE_HEADER``)
and their own key (``inference_key``: the same HKDF with another label), so a request signed for
one service is never accepted by the other; their audience is the ``host:port`` the client
addressed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import threading
import time
from urllib.parse import urlsplit

AUTH_HEADER = "X-Diloco-Auth"
TRANSPORT_LABEL = b"prime-composer diloco transport v1"
INFERENCE_HEADER = "X-Prime-Composer-Auth"
INFERENCE_LABEL = b"prime-composer inference requests v1"
_HEADER = re.compile(
    r"^v1 aud=(?P<aud>[A-Za-z0-9_.:\[\]-]{1,80}) ts=(?P<ts>\d{1,12}) nonce=(?P<nonce>[0-9a-f]{32}) "
    r"sig=(?P<sig>[0-9a-f]{64})$"
)


def hkdf_sha256(secret: bytes, info: bytes, length: int = 32, salt: bytes = b"") -> bytes:
    """RFC 5869 HKDF with SHA-256 (extract, then expand to ``length`` bytes)."""
    prk = hmac.new(salt or b"\0" * 32, secret, hashlib.sha256).digest()
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
        counter += 1
    return out[:length]


def transport_key(secret: bytes) -> bytes:
    """The key that signs requests, derived from the run's secret (never the secret itself)."""
    return hkdf_sha256(secret, TRANSPORT_LABEL)


def inference_key(secret: str) -> bytes:
    """The key that signs requests to inference servers, derived from ``inference.secret_env``'s
    secret (neither the secret nor the DiLoCo transport key)."""
    return hkdf_sha256(secret.encode("utf-8", errors="surrogateescape"), INFERENCE_LABEL)


def _message(method: str, path: str, body: bytes, audience: str, ts: int, nonce: str) -> bytes:
    digest = hashlib.sha256(body).hexdigest()
    return "\n".join(["v1", method.upper(), path, digest, audience, str(ts), nonce]).encode()


def sign_request(
    key: bytes,
    method: str,
    path: str,
    body: bytes,
    audience: str,
    now: float | None = None,
    nonce: str | None = None,
) -> str:
    """The ``X-Diloco-Auth`` value of one request to server ``audience`` (a fresh nonce each call)."""
    ts = int(time.time() if now is None else now)
    nonce = nonce or secrets.token_hex(16)
    sig = hmac.new(key, _message(method, path, body, audience, ts, nonce), hashlib.sha256).hexdigest()
    return f"v1 aud={audience} ts={ts} nonce={nonce} sig={sig}"


class Verifier:
    """Checks ``X-Diloco-Auth`` on a server named ``audience`` (thread-safe; None: any audience,
    for a server that is not told its name)."""

    def __init__(
        self, key: bytes, audience: str | None, window_s: float = 120.0, max_nonces: int = 200_000
    ) -> None:
        self._key = key
        self.audience = audience
        self.window_s = window_s
        self.max_nonces = max_nonces
        self._seen: dict[str, float] = {}
        self._pruned = time.time()
        self._lock = threading.Lock()

    def check(
        self, method: str, path: str, body: bytes, header: str | None, now: float | None = None
    ) -> str | None:
        """None when the request is authentic and new; else why it is refused (no secret in it)."""
        match = _HEADER.match(header or "")
        if match is None:
            return f"missing or malformed {AUTH_HEADER} header"
        now = time.time() if now is None else now
        ts, nonce = int(match["ts"]), match["nonce"]
        expected = hmac.new(
            self._key, _message(method, path, body, match["aud"], ts, nonce), hashlib.sha256
        ).hexdigest()
        if not hmac.compare_digest(expected, match["sig"]):
            return "bad request signature (another secret, or the request was altered)"
        if self.audience is not None and match["aud"] != self.audience:
            return f"request is addressed to {match['aud']!r}, not to this server"
        if abs(now - ts) > self.window_s:
            return f"request timestamp is {now - ts:+.0f} s off (allowed: +-{self.window_s:.0f} s; check the clocks)"
        with self._lock:
            if len(self._seen) >= self.max_nonces or now - self._pruned > self.window_s:
                self._seen = {n: t for n, t in self._seen.items() if t > now - 2 * self.window_s}
                self._pruned = now
                if len(self._seen) >= self.max_nonces:
                    return "too many requests within the replay window"
            if nonce in self._seen:
                return "replayed request (nonce already seen)"
            self._seen[nonce] = now
        return None


def url_audience(url: str) -> str:
    """The audience a request to ``url`` is signed for: its ``host:port`` as addressed
    (lowercase, the scheme's default port filled in, an IPv6 address bracketed)."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{host}:{port}"


class Signer:
    """Signs requests with ``key`` under ``header`` (the client side of ``Verifier``)."""

    def __init__(self, key: bytes, header: str = INFERENCE_HEADER) -> None:
        self._key = key
        self.header = header

    def __repr__(self) -> str:  # never the key
        return f"Signer(header={self.header!r})"

    def headers(self, method: str, url: str, body: bytes) -> dict[str, str]:
        """The header that authenticates ``method url`` with ``body`` (a fresh nonce each call);
        the signed path is the URL's path with its query, as the server receives it."""
        parts = urlsplit(url)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return {self.header: sign_request(self._key, method, path, body, url_audience(url))}


def inference_signer(secret: str | None) -> Signer | None:
    """The signer of requests to inference servers guarded by ``secret`` (None: no secret)."""
    return Signer(inference_key(secret)) if secret else None


def inference_signer_from_env(secret_env: str | None) -> Signer | None:
    """``inference_signer`` of the secret in ``$secret_env`` (None when unnamed or unset: the
    caller that needs it says so, naming its own config key)."""
    return inference_signer(os.environ.get(secret_env) if secret_env else None)

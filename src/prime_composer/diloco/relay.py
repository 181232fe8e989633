"""A relay for DCs that accept no inbound connection (behind NAT or a firewall).

Every DC of a run with ``diloco.relay`` set publishes each payload to the relay as well as to its
own origin, and downloads from the relay the payloads of every peer listed without ``urls``. Only
outbound connections are needed, so a DC behind NAT takes part. Start the relay on a host all DCs
reach with ``rl relay`` (``launch/relay.py``)::

    rl certs --out relay-tls --name relay --host 203.0.113.7      # prints the fingerprint
    export DILOCO_RELAY_KEY=$(DILOCO_SECRET=... python -m prime_composer.diloco.relay key --secret-env DILOCO_SECRET)
    rl relay @ relay.toml    # kind = "diloco", key_env = "DILOCO_RELAY_KEY", host, port, dir, tls_cert, tls_key

and give the DCs ``relay = "203.0.113.7:7800@<fingerprint>"`` (the line it prints once ready).
``python -m prime_composer.diloco.relay serve --host ... --key-env ...`` (the older command) is an
alias: it runs ``rl relay --kind diloco`` with the same flags.

A relay can sit behind another one (``upstream``, a chain: DCs -> relay -> relay <- DCs), for DCs
that reach only a relay near them: it forwards each blob its DCs publish to the upstream relay (in
the background, after storing it), and asks the upstream relay for what it does not hold itself
(listings merged, its own entries first; a fetched blob is kept for the next reader). It signs
those requests with the same relay key and checks the upstream's pinned certificate; what it
forwards and caches is the sealed blob as it came, so a chain sees, and can do, nothing more than
one relay. Requests carry their hop count (``?hop=N``, signed with the path): a relay at
``MAX_HOPS`` answers from its own store only, so a loop of relays cannot recurse.

What the relay is trusted with, and what not:

- it holds ``relay_key = HKDF(secret, "relay")``, never the secret: HKDF is one-way, so neither
  the secret, nor the transport key of the DCs' origins (``auth.transport_key``), nor the payload
  signing key, nor the sealing key below can be computed from it. With it the relay checks that a
  request comes from a DC of the run (signed as in ``auth.py``, audience ``relay``, replay window,
  nonces), and a DC checks nothing more than the relay's pinned certificate;
- what it stores is *sealed*: AES-256-GCM under ``seal_key = HKDF(secret, "seal")`` with the slot
  ``<cluster>/<kind>/<round>`` as associated data, around a payload that is itself signed with the
  secret (``payload.py``). The relay sees ciphertext only (not the pseudo-gradients), cannot make
  a blob that opens, cannot alter one (GCM's tag fails) and cannot move one to another slot or
  round (the associated data differs); a reader then checks the payload's signature, sender,
  round and digest as for a direct download;
- it can withhold, delay or drop blobs (denial of service, as any router on the path can): the
  round's deadline leaves that DC out, exactly as when a peer is down.

Every DC can publish into any slot (they share the secret, as they already share the payload
signing key); a DC's slot is overwritten only by a newer request, and a blob that does not open
or verify is refused once (by its digest) and leaves its sender out of that round.

Bounds at the relay: a blob is at most ``--max-blob-bytes`` (refused from ``Content-Length``
before the body is read), all blobs together at most ``--max-total-bytes`` (a publish past it is
refused with 507 after expiring old rounds), at most ``--max-clusters`` senders, and a sender's
blobs older than ``--keep-rounds`` rounds behind its newest are deleted. Blobs live on disk
(written atomically) under ``--dir``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import ssl
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from prime_composer.io import atomic_write_bytes
from prime_composer.wire.auth import AUTH_HEADER, Verifier, hkdf_sha256
from prime_composer.wire.fetch import Peer, TransportError, request
from prime_composer.wire.serve import ServerThread

logger = logging.getLogger(__name__)

RELAY_LABEL = b"prime-composer diloco relay v1"
SEAL_LABEL = b"prime-composer diloco seal v1"
AUDIENCE = "relay"
SEAL_MAGIC = b"PCSEAL1\n"
SEAL_OVERHEAD = len(SEAL_MAGIC) + 12 + 16
"""Bytes a sealed blob adds to its payload (magic, GCM nonce, GCM tag)."""
MAX_LISTING_BYTES = 1 << 20
KINDS = ("grad", "commit", "state")
_CLUSTER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_SLOT = re.compile(r"^/v1/(?P<cluster>[^/]+)(?:/(?P<kind>[a-z]+)/(?P<round>\d{1,12}))?$")
_HOP = re.compile(r"^hop=(\d{1,2})$")
MAX_HOPS = 4
"""Relays a request may cross (a chain deeper than this answers from the store it reached)."""


def relay_key(secret: bytes) -> bytes:
    """The key a relay verifies requests with (derived from the run's secret; reveals nothing of it)."""
    return hkdf_sha256(secret, RELAY_LABEL)


def seal_key(secret: bytes) -> bytes:
    """The AES-256-GCM key of blobs stored at the relay (the relay never has it)."""
    return hkdf_sha256(secret, SEAL_LABEL)


def _aad(cluster: str, kind: str, round_: int) -> bytes:
    return f"{cluster}/{kind}/{round_}".encode()


def seal(key: bytes, cluster: str, kind: str, round_: int, payload: bytes) -> bytes:
    """``payload`` encrypted and authenticated for its slot (``SEAL_OVERHEAD`` bytes more)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    nonce = secrets.token_bytes(12)
    return SEAL_MAGIC + nonce + AESGCM(key).encrypt(nonce, payload, _aad(cluster, kind, round_))


def unseal(key: bytes, cluster: str, kind: str, round_: int, blob: bytes) -> bytes | None:
    """The payload in ``blob`` if it was sealed with ``key`` for this slot, else None."""
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    if len(blob) < SEAL_OVERHEAD or not blob.startswith(SEAL_MAGIC):
        return None
    nonce, body = blob[len(SEAL_MAGIC) : len(SEAL_MAGIC) + 12], blob[len(SEAL_MAGIC) + 12 :]
    try:
        return AESGCM(key).decrypt(nonce, body, _aad(cluster, kind, round_))
    except InvalidTag:
        return None


# ------------------------------------------------------------------------------------- server


@dataclass
class _Blob:
    size: int
    sha256: str
    stored_at: float


class RelayState:
    """The relay's blobs: ``{cluster: {(kind, round): _Blob}}`` on disk under ``directory``."""

    def __init__(
        self, directory: Path, max_blob_bytes: int, max_total_bytes: int, max_clusters: int, keep_rounds: int
    ) -> None:
        self.directory = Path(directory)
        self.max_blob_bytes = max_blob_bytes
        self.max_total_bytes = max_total_bytes
        self.max_clusters = max_clusters
        self.keep_rounds = keep_rounds
        self.lock = threading.Lock()
        self.blobs: dict[str, dict[tuple[str, int], _Blob]] = {}
        self.total_bytes = 0
        shutil.rmtree(self.directory, ignore_errors=True)  # a fresh relay: what was stored is stale
        self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, cluster: str, kind: str, round_: int) -> Path:
        return self.directory / cluster / f"{kind}-{round_}.bin"

    def _drop(self, cluster: str, slot: tuple[str, int]) -> None:
        blob = self.blobs[cluster].pop(slot)
        self.total_bytes -= blob.size
        self._path(cluster, *slot).unlink(missing_ok=True)

    def _expire(self, cluster: str) -> None:
        slots = self.blobs.get(cluster, {})
        if slots:
            newest = max(r for _, r in slots)
            for slot in [s for s in slots if s[1] < newest - self.keep_rounds]:
                self._drop(cluster, slot)

    def put(self, cluster: str, kind: str, round_: int, data: bytes) -> tuple[int, str]:
        """Store a blob; ``(status, message)``."""
        with self.lock:
            if cluster not in self.blobs and len(self.blobs) >= self.max_clusters:
                return 507, f"the relay serves at most {self.max_clusters} senders"
            slots = self.blobs.setdefault(cluster, {})
            if slots and round_ < max(r for _, r in slots) - self.keep_rounds:
                return 409, f"round {round_} is expired at this relay"
            old = slots.get((kind, round_))
            freed = old.size if old is not None else 0
            if self.total_bytes - freed + len(data) > self.max_total_bytes:
                return 507, f"the relay holds {self.total_bytes} of {self.max_total_bytes} bytes"
            atomic_write_bytes(self._path(cluster, kind, round_), data)
            self.total_bytes += len(data) - freed
            slots[(kind, round_)] = _Blob(len(data), hashlib.sha256(data).hexdigest(), time.time())
            self._expire(cluster)
            return 200, "stored"

    def listing(self, cluster: str) -> list[list[Any]]:
        with self.lock:
            return [[k, r, b.sha256, b.size] for (k, r), b in sorted(self.blobs.get(cluster, {}).items())]

    def get(self, cluster: str, kind: str, round_: int) -> bytes | None:
        with self.lock:
            if (kind, round_) not in self.blobs.get(cluster, {}):
                return None
            return self._path(cluster, kind, round_).read_bytes()


class _RelayHandler(BaseHTTPRequestHandler):
    verifier: Verifier
    state: RelayState
    upstream: _Upstream | None
    timeout = 30.0
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()

    def _reply(self, status: int, body: bytes = b"", content_type: str = "application/octet-stream") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def _slot(self) -> tuple[str, str | None, int | None] | None:
        path, _, query = self.path.partition("?")
        hop = _HOP.match(query)
        if query and hop is None:
            self._reply(404, b"the only query is hop=N")
            return None
        self.hop = int(hop[1]) if hop else 0
        match = _SLOT.match(path)
        if match is None or not _CLUSTER.match(match["cluster"]):
            self._reply(404, b"no such path")
            return None
        kind = match["kind"]
        if kind is not None and kind not in KINDS:
            self._reply(404, b"no such kind")
            return None
        return match["cluster"], kind, None if match["round"] is None else int(match["round"])

    def _authentic(self, body: bytes) -> bool:
        reason = self.verifier.check(self.command, self.path, body, self.headers.get(AUTH_HEADER))
        if reason is not None:
            self._reply(401, reason.encode(), "text/plain")
            return False
        return True

    def do_GET(self) -> None:
        if self.path == "/health":
            self._reply(200, b"ok", "text/plain")
            return
        slot = self._slot()
        if slot is None or not self._authentic(b""):
            return
        cluster, kind, round_ = slot
        upstream = self.upstream if self.hop < MAX_HOPS else None
        if kind is None or round_ is None:
            rows = self.state.listing(cluster)
            if upstream is not None:
                held = {(k, r) for k, r, _, _ in rows}
                rows += [
                    row for row in upstream.listing(cluster, self.hop + 1) if (row[0], row[1]) not in held
                ]
            self._reply(200, json.dumps(sorted(rows)).encode(), "application/json")
            return
        data = self.state.get(cluster, kind, round_)
        if data is None and upstream is not None:
            data = upstream.fetch(cluster, kind, round_, self.hop + 1, self.state.max_blob_bytes)
            if data is not None:
                self.state.put(cluster, kind, round_, data)  # kept for the next reader here
        self._reply(200, data) if data is not None else self._reply(404, b"not here")

    def do_PUT(self) -> None:
        slot = self._slot()
        if slot is None:
            return
        cluster, kind, round_ = slot
        if kind is None or round_ is None:
            self._reply(405, b"PUT a slot: /v1/<cluster>/<kind>/<round>")
            return
        length = self.headers.get("Content-Length", "")
        if not length.isdigit():
            self._reply(411, b"Content-Length required")
            return
        if int(length) > self.state.max_blob_bytes:
            self._reply(413, f"a blob is at most {self.state.max_blob_bytes} bytes".encode())
            return
        body = self.rfile.read(int(length))
        if len(body) != int(length) or not self._authentic(body):
            if len(body) != int(length):
                self._reply(400, b"short body")
            return
        status, message = self.state.put(cluster, kind, round_, body)
        if status == 200 and self.upstream is not None and self.hop < MAX_HOPS:
            self.upstream.forward(cluster, kind, round_, body, self.hop + 1)
        self._reply(status, message.encode(), "text/plain")

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("relay %s: " + format, self.address_string(), *args)


def _relay_call(
    peer: Peer,
    errors: dict[str, int],
    method: str,
    path: str,
    deadline: float,
    max_bytes: int,
    body: bytes,
    *,
    who: str,
    warn_http: bool = False,
) -> bytes | None:
    """One signed call to a relay: the reply's body on a 200, else None with the failure counted
    in ``errors`` (the transport's reason, or ``http_<status>``). A certificate that does not match
    its pin is logged as an error, other transport failures at debug level, and with ``warn_http``
    an HTTP error other than 404 (which only says a blob is not there) as a warning."""
    try:
        status, data = request(peer, method, path, deadline, max_bytes, body)
    except TransportError as e:
        errors[e.reason] = errors.get(e.reason, 0) + 1
        (logger.error if e.reason == "pin" else logger.debug)("%s: %s", who, e)
        return None
    if status != 200:
        errors[f"http_{status}"] = errors.get(f"http_{status}", 0) + 1
        if warn_http and status != 404:
            logger.warning(
                "%s: %s %s: HTTP %d %s", who, method, path, status, data[:200].decode("utf-8", "replace")
            )
        return None
    return data


class _Upstream:
    """The relay a chained relay sits behind (see the module docstring): its DCs' blobs are
    forwarded there by one background thread (the newest first per slot, each try bounded by
    ``timeout_s``, a failed one retried until ``timeout_s`` after it came), and what this relay
    lacks is listed and fetched there, each call bounded by ``timeout_s``. Failures are counted in
    ``errors`` and cost only the answer's completeness: after a listing or fetch that found the
    upstream unreachable (no connection, or no answer in time), the next ``timeout_s`` of
    listings and fetches answer from this relay's own store at once, so an upstream that is down
    does not make every answer to this relay's own DCs wait for it."""

    def __init__(self, url: str, fingerprint: str | None, key: bytes, timeout_s: float) -> None:
        import queue

        self.peer = Peer(url, AUDIENCE, key, fingerprint)
        self.timeout_s = timeout_s
        self.errors: dict[str, int] = {}
        self.forwarded = 0
        self._down_until = 0.0
        self._queue: queue.Queue[tuple[str, str, int, bytes, int, float] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._forwarding, name="diloco-relay-upstream", daemon=True)
        self._thread.start()

    def _call(
        self, method: str, path: str, deadline: float, max_bytes: int, body: bytes = b""
    ) -> bytes | None:
        # HTTP errors are counted only (in errors): a forward that fails is retried every second.
        return _relay_call(
            self.peer, self.errors, method, path, deadline, max_bytes, body, who="diloco relay upstream"
        )

    def _ask(self, path: str, max_bytes: int) -> bytes | None:
        """A GET for a reader of this relay: skipped while the upstream is taken as down."""
        if time.monotonic() < self._down_until:
            self.errors["skipped_down"] = self.errors.get("skipped_down", 0) + 1
            return None
        before = self.errors.get("connect", 0) + self.errors.get("deadline", 0)
        data = self._call("GET", path, time.monotonic() + self.timeout_s, max_bytes)
        if self.errors.get("connect", 0) + self.errors.get("deadline", 0) > before:
            self._down_until = time.monotonic() + self.timeout_s
        return data

    def listing(self, cluster: str, hop: int) -> list[list[Any]]:
        data = self._ask(f"v1/{cluster}?hop={hop}", MAX_LISTING_BYTES)
        try:
            rows = json.loads(data) if data is not None else []
            return [[str(k), int(r), str(d), int(n)] for k, r, d, n in rows if k in KINDS]
        except (ValueError, TypeError):
            self.errors["malformed"] = self.errors.get("malformed", 0) + 1
            return []

    def fetch(self, cluster: str, kind: str, round_: int, hop: int, max_bytes: int) -> bytes | None:
        return self._ask(f"v1/{cluster}/{kind}/{round_}?hop={hop}", max_bytes)

    def forward(self, cluster: str, kind: str, round_: int, blob: bytes, hop: int) -> None:
        self._queue.put((cluster, kind, round_, blob, hop, time.monotonic() + self.timeout_s))

    def _forwarding(self) -> None:
        while (item := self._queue.get()) is not None:
            cluster, kind, round_, blob, hop, until = item
            while time.monotonic() < until:
                path = f"v1/{cluster}/{kind}/{round_}?hop={hop}"
                if (
                    self._call("PUT", path, min(until, time.monotonic() + self.timeout_s), 4096, blob)
                    is not None
                ):
                    self.forwarded += 1
                    break
                time.sleep(min(1.0, max(0.0, until - time.monotonic())))
            else:
                logger.warning(
                    "diloco relay: %s's %s of round %d did not reach the upstream relay",
                    cluster,
                    kind,
                    round_,
                )

    def close(self) -> None:
        self._queue.put(None)


class RelayServer:
    """The relay, serving in a thread (``close()`` stops it). ``tls`` None is plain HTTP (for
    loopback or a private network only; the command refuses it elsewhere). ``upstream``:
    ``(url, fingerprint)`` of the relay this one sits behind (a chain), with ``upstream_timeout_s``
    bounding each call to it."""

    def __init__(
        self,
        host: str,
        port: int,
        key: bytes,
        directory: Path,
        *,
        tls: ssl.SSLContext | None = None,
        max_blob_bytes: int = 1 << 30,
        max_total_bytes: int = 16 << 30,
        max_clusters: int = 64,
        keep_rounds: int = 8,
        window_s: float = 120.0,
        upstream: tuple[str, str | None] | None = None,
        upstream_timeout_s: float = 30.0,
    ) -> None:
        self.state = RelayState(directory, max_blob_bytes, max_total_bytes, max_clusters, keep_rounds)
        self.upstream = None if upstream is None else _Upstream(*upstream, key, upstream_timeout_s)
        handler = type(
            "Handler",
            (_RelayHandler,),
            {"verifier": Verifier(key, AUDIENCE, window_s), "state": self.state, "upstream": self.upstream},
        )
        self._serving = ServerThread(host, port, handler, tls=tls, name="diloco-relay")

    @property
    def port(self) -> int:
        return self._serving.port

    def close(self) -> None:
        self._serving.close()
        if self.upstream is not None:
            self.upstream.close()


# ------------------------------------------------------------------------------------- client


class RelayClient:
    """A DC's side of the relay: publish sealed payloads, list and fetch the peers' (each call
    bounded by its timeout; failures are ``None``/``False``, counted in ``errors``)."""

    def __init__(self, url: str, fingerprint: str | None, secret: bytes) -> None:
        self.peer = Peer(url, AUDIENCE, relay_key(secret), fingerprint)
        self._seal_key = seal_key(secret)
        self.errors: dict[str, int] = {}
        self.refused: set[str] = set()
        """SHA-256 of blobs that did not open (not downloaded again)."""

    def close(self) -> None:
        """Nothing to release: each call opens and closes its own connection (``RelayGroup``
        has publishes in flight to stop)."""

    def _call(
        self, method: str, path: str, timeout_s: float, max_bytes: int, body: bytes = b""
    ) -> bytes | None:
        deadline = time.monotonic() + timeout_s
        return _relay_call(
            self.peer,
            self.errors,
            method,
            path,
            deadline,
            max_bytes,
            body,
            who="diloco relay",
            warn_http=True,
        )

    def publish(self, cluster: str, kind: str, round_: int, payload: bytes, timeout_s: float) -> bool:
        blob = seal(self._seal_key, cluster, kind, round_, payload)
        return self._call("PUT", f"v1/{cluster}/{kind}/{round_}", timeout_s, 4096, blob) is not None

    def listing(self, cluster: str, timeout_s: float) -> dict[tuple[str, int], str] | None:
        """``{(kind, round): sha256}`` of ``cluster``'s blobs, or None when the relay does not answer."""
        data = self._call("GET", f"v1/{cluster}", timeout_s, MAX_LISTING_BYTES)
        if data is None:
            return None
        try:
            rows = json.loads(data)
            return {(str(k), int(r)): str(d) for k, r, d, _ in rows if k in KINDS}
        except (ValueError, TypeError):
            self.errors["malformed"] = self.errors.get("malformed", 0) + 1
            return None

    def fetch(
        self,
        cluster: str,
        kind: str,
        round_: int,
        timeout_s: float,
        max_bytes: int,
        digest: str | None = None,
    ) -> bytes | None:
        """The payload in ``cluster``'s blob of (``kind``, ``round_``) if it opens, else None."""
        if digest is not None and digest in self.refused:
            return None
        blob = self._call("GET", f"v1/{cluster}/{kind}/{round_}", timeout_s, max_bytes + SEAL_OVERHEAD)
        if blob is None:
            return None
        payload = unseal(self._seal_key, cluster, kind, round_, blob)
        if payload is None:
            self.refused.add(hashlib.sha256(blob).hexdigest())
            self.errors["bad_seal"] = self.errors.get("bad_seal", 0) + 1
            logger.warning("diloco relay: %s's %s of round %d does not open: refused", cluster, kind, round_)
        return payload


class RelayGroup:
    """Several relays (``diloco.relay`` a list) used as one ``RelayClient``, for failover: every
    payload is published to all of them at once (``publish`` returns once one has it; the others
    finish in the background), and listings and fetches ask the relay that answered last first,
    then the others in order, so a relay that is down costs one failed call, not every call."""

    def __init__(self, clients: list[RelayClient]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.clients = clients
        self._first = 0
        self._pool = ThreadPoolExecutor(max_workers=2 * len(clients), thread_name_prefix="relay-publish")

    @property
    def errors(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for client in self.clients:
            for reason, n in client.errors.items():
                total[reason] = total.get(reason, 0) + n
        return total

    @property
    def refused(self) -> set[str]:
        return set().union(*(c.refused for c in self.clients))

    def _in_turn(self) -> list[tuple[int, RelayClient]]:
        order = list(enumerate(self.clients))
        return order[self._first :] + order[: self._first]

    def publish(self, cluster: str, kind: str, round_: int, payload: bytes, timeout_s: float) -> bool:
        from concurrent.futures import FIRST_COMPLETED, wait

        pending = {
            self._pool.submit(c.publish, cluster, kind, round_, payload, timeout_s) for c in self.clients
        }
        while pending:
            done, pending = wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)
            if not done or any(f.result() for f in done):
                return bool(done)
        return False

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def listing(self, cluster: str, timeout_s: float) -> dict[tuple[str, int], str] | None:
        deadline = time.monotonic() + timeout_s
        for i, client in self._in_turn():
            listed = client.listing(cluster, max(0.1, deadline - time.monotonic()))
            if listed is not None:
                self._first = i
                return listed
        return None

    def fetch(
        self,
        cluster: str,
        kind: str,
        round_: int,
        timeout_s: float,
        max_bytes: int,
        digest: str | None = None,
    ) -> bytes | None:
        deadline = time.monotonic() + timeout_s
        for i, client in self._in_turn():
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            payload = client.fetch(cluster, kind, round_, left, max_bytes, digest)
            if payload is not None:
                self._first = i
                return payload
        return None


# -------------------------------------------------------------------------------------- command


def _secret_from(env: str) -> bytes:
    value = os.environ.get(env)
    if not value:
        raise SystemExit(f"environment variable {env} is unset or empty")
    return value.encode()


def main(argv: list[str] | None = None) -> int:
    """``key --secret-env S``: print the relay key. ``serve --flags``: the older front-end, now
    ``rl relay --kind diloco --flags`` (the same flags: ``--host``, ``--port``, ``--key-env``,
    ``--dir``, ``--tls-cert``, ``--tls-key``, ``--private-network``, ``--max-blob-bytes``, ...)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["serve"]:
        # One way to start a relay: this process becomes `rl relay` (launch/relay.py; diloco/
        # imports nothing of launch/, so it is run, not imported).
        command = [sys.executable, "-m", "prime_composer.launch.relay", "--kind", "diloco", *args[1:]]
        os.execv(sys.executable, command)
    parser = argparse.ArgumentParser(
        prog="python -m prime_composer.diloco.relay",
        description='The DiLoCo relay\'s key (the relay itself: `rl relay @ relay.toml`, kind = "diloco").',
    )
    sub = parser.add_subparsers(dest="command", required=True)
    key = sub.add_parser(
        "key", help="print the relay key derived from the run's secret (give it to the relay)"
    )
    key.add_argument("--secret-env", required=True, help="environment variable holding the run's secret")
    sub.add_parser("serve", help="run the relay: an alias of `rl relay --kind diloco` with the same flags")
    parsed = parser.parse_args(args)
    assert parsed.command == "key"
    print(relay_key(_secret_from(parsed.secret_env)).hex())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Publishing payloads from a shardcast origin and fetching peers' payloads, with deadlines.

Each DC serves its own payloads in shardcast's layout (``v<N>/shard_<i>.bin`` and
``distribution.txt`` listing ``v<N>: <blake3>|<num shards>``), and downloads its peers' with
shardcast's client (parallel shard downloads spread over a peer's origin and relays by measured
speed and success rate, blake3-verified). A payload of kind ``grad``/``commit``/``state`` for
round ``r`` is version ``3 r + 1``/``+ 2``/``+ 3``, so a reader knows which version to ask for.

shardcast 0.3.2 is used without patching its files, working around its defects:

- its origin binds 0.0.0.0, has no authentication or TLS, serves one request at a time and its
  ``shutdown()`` blocks until a request arrives: the origin here is a threaded ``http.server``
  bound to ``diloco.host`` (127.0.0.1 by default), serving HTTPS with ``diloco.tls_cert`` when
  set, and requiring a signed request (``auth.py``: HMAC over method, path, body, audience,
  timestamp and nonce, keyed by a key derived from the secret) on every path but ``/health``.
  shardcast's own layout helpers write the files;
- it rewrites ``distribution.txt`` in place (a reader can see half of it): written to a temp
  file and renamed;
- its client probes a ``data1.bin`` the origin never writes, writes ``/tmp/dummy.bin`` (shared by
  every client on a host) and a temp file inside site-packages, shells out to ``wget`` (and runs
  ``apt install wget`` when missing), retries forever, and crashes in ``random.choices`` when
  every server's success rate reaches 0: ``_Downloader`` overrides those methods to fetch
  in-process (``transport.request``: signed, certificate-pinned, under one wall-clock deadline
  for the whole download, byte-capped), into this DC's own download directory, and falls back to
  uniform server weights.

The retry loop (``_Downloader.download_file``) stays here rather than in ``client/http.py``'s
``EndpointClient``: that client is async, parses JSON, sends a fixed bearer header, bounds each
attempt and retries failures with backoff, while a shard fetch is a binary GET from a pool of
threads, signed afresh per request (a nonce each), byte-capped before the body is read, pinned,
and its attempts share one wall-clock deadline; a payload not yet published is polled for at
``poll_interval_s``, not retried as a failure. Each attempt goes through ``wire.fetch.request``,
the one client of the links between DCs.

What another DC sends is bounded before it is used: ``distribution.txt`` at
``MAX_DISTRIBUTION_BYTES``; a version listing more shards than its byte cap allows
(``max_bytes`` of ``fetch``, else ``MAX_SHARDS``) is refused without downloading a shard; shards
are cut off at ``SHARD_BYTES`` and the whole payload at ``max_bytes``; every request of a fetch
shares the fetch's deadline (a trickling peer cannot stretch it). A version refused for its
size, shard count or checksum is remembered (by its checksum) and counted once in
``ShardcastStore.refused``: asking again returns ``None`` without downloading it again.

With a relay (``diloco.relay``, ``relay.py``): every grad and commit is also published, sealed,
to the relay (states too when the origin is on loopback, see ``relay_states``), and a peer listed without URLs (a DC behind NAT) is listed and fetched from the relay
instead of its origin; what it returns goes through the same checks as a direct download.

Failures come back as ``None`` (data), never as exceptions.

**The last round outlives the run** (``ShardcastStore.linger``). Every request names its sender
(``?dc=<cluster id>``, covered by the request's signature), and the origin records which peer has
downloaded every shard of which version. When a run ends, its origin stays up until every peer that
still needs something of the newest round this DC applied has downloaded it from here: each other
member this DC's grad, and every peer its commit when this DC committed the round (``Exchange.owed``).
Peers that never fetched from this origin (those reaching it through the relay) and peers whose
own origin no longer answers (gone, or finished) are not waited for, and the wait is bounded by
``round_deadline_s``: a dead peer cannot hold a finished run. Without it a coordinator that ends
right after its last commit leaves its peer to wait out the commit deadline and fail over.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import ssl
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from functools import partial
from http.server import SimpleHTTPRequestHandler
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from shardcast.client import ServerMetrics, ShardDownloader
from shardcast.utils import compute_checksum, get_shard_count, get_shard_filename, update_distribution_file

from prime_composer.config.diloco import parse_relay
from prime_composer.diloco.base import register_store
from prime_composer.diloco.payload import Kind
from prime_composer.diloco.relay import RelayClient, RelayGroup
from prime_composer.io import atomic_write_bytes
from prime_composer.netaddr import is_loopback
from prime_composer.wire.auth import AUTH_HEADER, Verifier, transport_key
from prime_composer.wire.fetch import Peer, TransportError, request
from prime_composer.wire.serve import ServerThread
from prime_composer.wire.tls import server_context

if TYPE_CHECKING:
    from prime_composer.config.diloco import DilocoConfig

logger = logging.getLogger(__name__)
logging.getLogger("shardcast").setLevel(logging.WARNING)  # it logs every shard at INFO

DISTRIBUTION_FILE = "distribution.txt"
SHARD_BYTES = 8 << 20
"""Shard size: big enough to amortise a request, small enough to download several in parallel."""
MAX_SHARDS = 512
"""Most shards a version may list when the caller gives no ``max_bytes`` (4 GiB)."""
MAX_DISTRIBUTION_BYTES = 64 << 10
"""Largest ``distribution.txt`` read from a peer (it lists ``3 * keep_rounds`` short lines)."""
_DISTRIBUTION_TIMEOUT_S = 10.0
_LINGER_PROBE_S = 1.0
"""How often a lingering origin checks that the peers it waits for are still up."""

_KIND_OFFSET: dict[str, int] = {"grad": 1, "commit": 2, "state": 3}


def version_of(kind: Kind, round_: int) -> str:
    """The shardcast version that holds ``kind`` of round ``round_``."""
    return f"v{3 * round_ + _KIND_OFFSET[kind]}"


def round_of(version: str, kind: Kind) -> int | None:
    """The round a version holds if it is of ``kind``, else None."""
    try:
        number = int(version.removeprefix("v"))
    except ValueError:
        return None
    round_, offset = divmod(number - 1, 3)
    return round_ if offset + 1 == _KIND_OFFSET[kind] else None


def _parse_distribution(text: str) -> dict[str, tuple[str, int]]:
    """``{version: (blake3, num_shards)}`` of a distribution file (bad lines ignored)."""
    out: dict[str, tuple[str, int]] = {}
    for line in text.splitlines():
        version, _, info = line.partition(":")
        checksum, _, shards = info.strip().partition("|")
        with contextlib.suppress(ValueError):
            out[version.strip()] = (checksum, int(shards))
    return out


# ------------------------------------------------------------------------------------- origin


class _Handler(SimpleHTTPRequestHandler):
    verifier: Verifier | None = None
    served: Callable[[str, str], None] | None = None
    """Called with ``(sender, path)`` after a file was sent to a request naming its sender."""
    timeout = 30.0  # per socket operation: a client that stalls does not hold a thread forever

    def setup(self) -> None:
        super().setup()
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()  # here, in this request's thread, not in accept()

    def do_GET(self) -> None:
        if self.path == "/health":
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")
            return
        if self.verifier is not None:
            reason = self.verifier.check("GET", self.path, b"", self.headers.get(AUTH_HEADER))
            if reason is not None:
                self.send_error(401, reason)
                return
        path, _, query = self.path.partition("?")
        if path.endswith("/"):
            self.send_error(404)
            return
        sent = os.path.isfile(self.translate_path(path))
        super().do_GET()
        sender = parse_qs(query).get("dc", [""])[0]
        if sent and sender and self.served is not None:
            self.served(sender, path)

    def do_HEAD(self) -> None:
        self.send_error(405)

    def list_directory(self, path: Any) -> None:
        self.send_error(404)
        return None

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("origin %s: " + format, self.address_string(), *args)


class Origin:
    """This DC's shardcast origin: writes payloads as shardcast versions and serves them.

    ``secret`` set: every path but ``/health`` needs a request signed with the key derived from
    it, addressed to ``audience`` (this DC's cluster id; None accepts any audience) within
    ``window_s`` of this clock. ``tls`` set: served over HTTPS with that context. ``senders``: the
    cluster ids whose downloads are recorded (``seen``, ``fetched``); others are served alike."""

    def __init__(
        self,
        directory: Path,
        host: str,
        port: int,
        secret: str | bytes | None,
        keep_versions: int,
        *,
        audience: str | None = None,
        tls: ssl.SSLContext | None = None,
        window_s: float = 120.0,
        senders: Iterable[str] = (),
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep_versions = keep_versions
        self._lock = threading.Lock()
        self._senders = frozenset(senders)
        self._record_lock = threading.Lock()
        self._seen: set[str] = set()
        self._num_shards: dict[str, int] = {}
        self._fetched: dict[tuple[str, str], set[str]] = {}
        """``(sender, version)`` -> the shard files of that version sent to that sender."""
        dist = self.directory / DISTRIBUTION_FILE
        if not dist.exists():
            atomic_write_bytes(dist, b"")
        verifier = None
        if secret:
            key = transport_key(secret.encode() if isinstance(secret, str) else secret)
            verifier = Verifier(key, audience, window_s)
        handler = type("Handler", (_Handler,), {"verifier": verifier, "served": self._served})
        self._serving = ServerThread(
            host, port, partial(handler, directory=str(self.directory)), tls=tls, name="diloco-origin"
        )
        self.scheme = self._serving.scheme

    @property
    def port(self) -> int:
        return self._serving.port

    def _served(self, sender: str, path: str) -> None:
        if sender not in self._senders:
            return
        version, _, name = path.strip("/").partition("/")
        with self._record_lock:
            self._seen.add(sender)
            if version in self._num_shards and name.startswith("shard_"):
                self._fetched.setdefault((sender, version), set()).add(name)

    def seen(self, sender: str) -> bool:
        """Whether ``sender`` has downloaded anything from this origin."""
        with self._record_lock:
            return sender in self._seen

    def fetched(self, sender: str, version: str) -> bool:
        """Whether every shard of ``version`` has been sent to ``sender``."""
        with self._record_lock:
            num_shards = self._num_shards.get(version)
            return num_shards is not None and len(self._fetched.get((sender, version), ())) >= num_shards

    def publish(self, kind: Kind, round_: int, data: bytes) -> None:
        """Serve ``data`` as the version of (``kind``, ``round_``); drop the oldest versions."""
        version = version_of(kind, round_)
        try:
            self._publish(version, data)
        except OSError as e:  # a write error has no file name: say where it was writing
            if e.filename is None:
                raise OSError(e.errno, e.strerror, str(self.directory / version)) from e
            raise

    def _publish(self, version: str, data: bytes) -> None:
        with self._lock:
            final = self.directory / version
            tmp = Path(tempfile.mkdtemp(prefix=f".{version}.", dir=self.directory))
            source = tmp / "payload.bin"
            source.write_bytes(data)
            num_shards = max(1, get_shard_count(len(data), SHARD_BYTES))
            for i in range(num_shards):
                (tmp / get_shard_filename(i)).write_bytes(data[i * SHARD_BYTES : (i + 1) * SHARD_BYTES])
            checksum = compute_checksum(str(source))
            source.unlink()
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            # shardcast rewrites the file in place: do it on a copy and rename it over.
            dist = self.directory / DISTRIBUTION_FILE
            work = self.directory / f".{DISTRIBUTION_FILE}.work"
            shutil.copyfile(dist, work)
            removed = update_distribution_file(str(work), version, checksum, self.keep_versions, num_shards)
            atomic_write_bytes(dist, work.read_bytes())
            work.unlink()
            with self._record_lock:
                self._num_shards[version] = num_shards
                for key in [k for k in self._fetched if k[1] == version or k[1] in removed]:
                    del self._fetched[key]
                for old in removed:
                    self._num_shards.pop(old, None)
            for old in removed:
                shutil.rmtree(self.directory / old, ignore_errors=True)

    def close(self) -> None:
        self._serving.close()


# ------------------------------------------------------------------------------------- client


class _Downloader(ShardDownloader):
    """shardcast's downloader with its defects worked around (see the module docstring).

    One download at a time (the store holds a lock per peer): ``begin`` sets the deadline every
    request of it shares and the byte budget its shards draw from."""

    def __init__(self, peers: list[Peer], poll_interval_s: float, sender: str | None = None) -> None:
        # Not super().__init__: it would check for wget (installing it) and probe data1.bin.
        self._peers = {p.url.rstrip("/"): p for p in peers}
        self._query = f"?dc={sender}" if sender else ""
        """Names this DC to the peer's origin (``Origin.fetched``); the signature covers it."""
        self.servers = list(self._peers)
        self.timeout = 30
        self.metrics_lock = threading.Lock()
        self.server_metrics = {s: ServerMetrics(bandwidth_mbps=1.0, success_rate=1.0) for s in self.servers}
        self.deadline = time.monotonic()
        self.poll_interval_s = poll_interval_s
        self._budget_lock = threading.Lock()
        self._bytes_left = 0
        self.over_cap = False
        self.errors: Counter[str] = Counter()
        """Failed requests by reason (``deadline``, ``too_large``, ``pin``, ``connect``, ``http_<code>``)."""
        self._warned: set[tuple[str, str]] = set()

    def begin(self, deadline: float, max_bytes: int) -> None:
        self.deadline = deadline
        self._bytes_left = max_bytes
        self.over_cap = False

    def _sample_best_server(self) -> str:
        with self.metrics_lock:
            weights = [
                self.server_metrics[s].success_rate * self.server_metrics[s].bandwidth_mbps
                for s in self.servers
            ]
        if not any(w > 0 for w in weights):
            return random.choice(self.servers)
        return random.choices(self.servers, weights=weights, k=1)[0]

    def _remaining(self) -> float:
        return self.deadline - time.monotonic()

    def _failed(self, server: str, reason: str, detail: str) -> None:
        self.errors[reason] += 1
        if reason == "pin" and (server, reason) not in self._warned:
            self._warned.add((server, reason))
            logger.error("diloco: %s", detail)
        else:
            logger.debug("diloco: %s", detail)

    def _get(self, server: str, url_path: str, max_bytes: int, deadline: float) -> tuple[bytes | None, str]:
        """``(body, "")`` or ``(None, reason)``."""
        try:
            status, data = request(self._peers[server], "GET", url_path + self._query, deadline, max_bytes)
        except TransportError as e:
            self._failed(server, e.reason, str(e))
            return None, e.reason
        if status != 200:
            self._failed(server, f"http_{status}", f"{server}/{url_path}: HTTP {status}")
            return None, f"http_{status}"
        return data, ""

    def _download_file(
        self, server: str, url_path: str, output_path: Path | str, update_metrics: bool = True
    ) -> bool:
        """One attempt at one shard from ``server``, within the download's deadline and budget."""
        if self.over_cap or self._remaining() <= 0:
            return False
        with self._budget_lock:
            cap = min(SHARD_BYTES, self._bytes_left)
        start = time.monotonic()
        data, reason = self._get(server, url_path, cap, self.deadline)
        if data is None:
            if reason == "too_large":
                self.over_cap = True  # a shard over SHARD_BYTES, or more than the payload may weigh
            self._update_server_metrics(server, 0.0, False)
            return False
        with self._budget_lock:
            self._bytes_left -= len(data)
            if self._bytes_left < 0:
                self.over_cap = True
                return False
        atomic_write_bytes(Path(output_path), data)
        if update_metrics:
            mbps = len(data) / max(time.monotonic() - start, 1e-6) / 1e6
            self._update_server_metrics(server, max(mbps, 1e-3), True)
        return True

    def download_file(
        self,
        url_path: str,
        output_path: str,
        update_metrics: bool = True,
        retries: int = 1,
        log_error_on_failure: bool = False,
    ) -> bool:
        """Try the servers until the deadline (shardcast's version retries forever)."""
        os.makedirs(os.path.dirname(output_path), exist_ok=True)
        while True:
            if self._download_file(self._sample_best_server(), url_path, output_path, update_metrics):
                return True
            if self.over_cap or self._remaining() <= 0:
                return False
            time.sleep(min(self.poll_interval_s, max(0.0, self._remaining())))

    def _download_shard_with_retry(self, url_path: str, output_path: str, shard_index: int) -> str | None:
        return output_path if self.download_file(url_path, output_path) else None

    def get_text(self, url_path: str) -> str | None:
        """One attempt at a small file on any server (the distribution file); None on failure."""
        for server in random.sample(self.servers, len(self.servers)):
            deadline = min(self.deadline, time.monotonic() + _DISTRIBUTION_TIMEOUT_S)
            if deadline <= time.monotonic():
                return None
            data, _ = self._get(server, url_path, MAX_DISTRIBUTION_BYTES, deadline)
            if data is not None:
                return data.decode("utf-8", "replace")
        return None

    def close(self) -> None:
        pass


class ShardcastStore:
    """This DC's origin plus one shardcast client per peer.

    ``peers`` maps each peer's cluster id to its URLs, as strings (plain ``http://``, signed with
    the key derived from ``secret`` and addressed to that cluster id) or as ``Peer``s (which say
    all of it, pins included: ``from_config`` builds those)."""

    def __init__(
        self,
        directory: Path,
        host: str,
        port: int,
        peers: dict[str, list[str]] | dict[str, list[Peer]],
        secret: str | bytes | None,
        keep_rounds: int,
        poll_interval_s: float,
        *,
        cluster_id: str | None = None,
        tls: ssl.SSLContext | None = None,
        window_s: float = 120.0,
        relay: RelayClient | RelayGroup | None = None,
        publish_timeout_s: float = 60.0,
    ) -> None:
        self.directory = Path(directory)
        self.cluster_id = cluster_id
        self.relay = relay
        self.publish_timeout_s = publish_timeout_s
        if isinstance(secret, str):
            secret = secret.encode()
        self.origin = Origin(
            self.directory / "origin",
            host,
            port,
            secret,
            keep_versions=3 * keep_rounds,
            audience=cluster_id,
            tls=tls,
            window_s=window_s,
            senders=peers,
        )
        self.poll_interval_s = poll_interval_s
        key = transport_key(secret) if secret else None
        self.relay_states = is_loopback(host)
        """Whether this DC's ``state`` payloads (8 bytes a value of a fragment, each round it
        commits: ~8x an int4 grad) go to the relay too: only when its origin is on loopback, so
        that no peer can reach it. A DC that serves other machines keeps them on its origin, and
        every peer lists it with its URL (a peer catching up downloads states from there)."""
        self.relayed = {c for c, urls in peers.items() if not urls}
        """Peers without URLs: fetched from the relay."""
        if self.relayed and (relay is None or cluster_id is None):
            raise ValueError(f"peers {sorted(self.relayed)} have no URL and no relay is set (diloco.relay)")
        self._downloaders = {
            c: _Downloader(
                [u if isinstance(u, Peer) else Peer(u, c, key) for u in urls], poll_interval_s, cluster_id
            )
            for c, urls in peers.items()
            if urls
        }
        self._locks = {c: threading.Lock() for c in peers}
        self.refused: Counter[str] = Counter()
        """Versions refused (``too_many_shards``, ``too_large``, ``bad_checksum``), each counted once."""
        self._refused_versions: dict[tuple[str, str, str, int], str] = {}

    @classmethod
    def from_config(cls, cfg: DilocoConfig, work_dir: Path, secret: bytes | None) -> ShardcastStore:
        """The store of ``cfg``: its origin (HTTPS when ``tls_cert`` is set) and its peers (pinned)."""
        key = transport_key(secret) if secret else None
        peers = {p.cluster_id: [Peer(u, p.cluster_id, key, p.fingerprint) for u in p.urls] for p in cfg.peers}
        tls = None
        if cfg.tls_cert is not None and cfg.tls_key is not None:
            tls = server_context(cfg.tls_cert, cfg.tls_key)
        relay: RelayClient | RelayGroup | None = None
        if cfg.relays and secret:
            clients = [RelayClient(*parse_relay(r), secret) for r in cfg.relays]
            relay = clients[0] if len(clients) == 1 else RelayGroup(clients)
        return cls(
            work_dir,
            cfg.host,
            cfg.port,
            peers,
            secret,
            cfg.keep_rounds,
            cfg.poll_interval_s,
            cluster_id=cfg.cluster_id,
            tls=tls,
            window_s=cfg.auth_window_s,
            relay=relay,
            publish_timeout_s=cfg.round_deadline_s,
        )

    @property
    def transport_errors(self) -> Counter[str]:
        """Failed requests to all peers by reason."""
        total: Counter[str] = Counter()
        for d in self._downloaders.values():
            total.update(d.errors)
        if self.relay is not None:
            total.update({f"relay_{k}": v for k, v in self.relay.errors.items()})
        return total

    def publish(self, kind: Kind, round_: int, data: bytes) -> None:
        self.origin.publish(kind, round_, data)
        if self.relay is not None and (kind != "state" or self.relay_states):
            assert self.cluster_id is not None
            if not self.relay.publish(self.cluster_id, kind, round_, data, self.publish_timeout_s):
                logger.warning("diloco: publishing %s of round %d to the relay failed", kind, round_)

    def _versions(self, cluster: str, deadline: float) -> dict[str, tuple[str, int]] | None:
        downloader = self._downloaders[cluster]
        with self._locks[cluster]:
            downloader.begin(deadline, MAX_DISTRIBUTION_BYTES)
            text = downloader.get_text(DISTRIBUTION_FILE)
        return None if text is None else _parse_distribution(text)

    def versions(self, cluster: str, timeout_s: float = 5.0) -> dict[str, tuple[str, int]] | None:
        """The peer's distribution file, or None when it does not answer."""
        return self._versions(cluster, time.monotonic() + timeout_s)

    def available(self, cluster: str, timeout_s: float) -> set[tuple[str, int]] | None:
        """The ``(kind, round)`` pairs the peer serves now, or None when it does not answer."""
        if cluster in self.relayed:
            assert self.relay is not None
            listing = self.relay.listing(cluster, timeout_s)
            return None if listing is None else set(listing)  # type: ignore[arg-type]
        versions = self.versions(cluster, timeout_s)
        if versions is None:
            return None
        out: set[tuple[str, int]] = set()
        for version in versions:
            for kind in _KIND_OFFSET:
                if (r := round_of(version, kind)) is not None:  # type: ignore[arg-type]
                    out.add((kind, r))
        return out

    def _refuse(self, key: tuple[str, str, str, int], reason: str) -> None:
        if key not in self._refused_versions:
            self._refused_versions[key] = reason
            self.refused[reason] += 1
            logger.warning("diloco: %s %s refused: %s", key[0], key[1], reason)
            while len(self._refused_versions) > 4096:
                self._refused_versions.pop(next(iter(self._refused_versions)))

    def fetch(
        self, cluster: str, kind: Kind, round_: int, timeout_s: float, max_bytes: int | None = None
    ) -> bytes | None:
        """The peer's payload of (``kind``, ``round_``) if it is published and downloads (blake3
        checked) within ``timeout_s`` in all, at most ``max_bytes`` long (None: ``MAX_SHARDS``
        shards); None otherwise (not there yet, peer down, too slow, too big, refused before)."""
        if cluster in self.relayed:
            return self._fetch_relayed(cluster, kind, round_, timeout_s, max_bytes)
        deadline = time.monotonic() + timeout_s
        version = version_of(kind, round_)
        versions = self._versions(cluster, deadline)
        if versions is None or version not in versions:
            return None
        checksum, num_shards = versions[version]
        key = (cluster, version, checksum, num_shards)
        if key in self._refused_versions:
            return None
        cap = max_bytes if max_bytes is not None else MAX_SHARDS * SHARD_BYTES
        if not 1 <= num_shards <= max(1, -(-cap // SHARD_BYTES)):
            self._refuse(key, "too_many_shards")
            return None
        downloader = self._downloaders[cluster]
        target = self.directory / "downloads" / cluster / version
        shutil.rmtree(target, ignore_errors=True)
        with self._locks[cluster]:
            downloader.begin(deadline, cap)
            shards = downloader.download_shards(version, num_shards, str(target))
            over_cap = downloader.over_cap
        try:
            if over_cap:
                self._refuse(key, "too_large")
                return None
            if len(shards) != num_shards:
                return None
            whole = target / "payload.bin"
            with open(whole, "wb") as out:
                for i in range(num_shards):
                    out.write((target / get_shard_filename(i)).read_bytes())
            if compute_checksum(str(whole)) != checksum:
                self._refuse(key, "bad_checksum")
                return None
            return whole.read_bytes()
        finally:
            shutil.rmtree(target, ignore_errors=True)

    def _fetch_relayed(
        self, cluster: str, kind: Kind, round_: int, timeout_s: float, max_bytes: int | None
    ) -> bytes | None:
        """``fetch`` of a peer behind NAT: its sealed blob from the relay, opened (or None)."""
        assert self.relay is not None
        deadline = time.monotonic() + timeout_s
        listing = self.relay.listing(cluster, timeout_s)
        if listing is None or (kind, round_) not in listing:
            return None
        cap = max_bytes if max_bytes is not None else MAX_SHARDS * SHARD_BYTES
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        return self.relay.fetch(cluster, kind, round_, left, cap, listing[(kind, round_)])

    def linger(self, owed: dict[str, list[tuple[Kind, int]]], timeout_s: float) -> list[str]:
        """Keep serving until each peer in ``owed`` has downloaded the listed payloads from this
        origin, is gone, or never fetched from here (see the module docstring), for at most
        ``timeout_s``. Returns the peers still waited for at the deadline."""
        versions = {c: [version_of(k, r) for k, r in items] for c, items in owed.items()}
        until = time.monotonic() + timeout_s
        probed = time.monotonic()

        def still_owed(peers: Iterable[str]) -> list[str]:
            return [c for c in peers if not all(self.origin.fetched(c, v) for v in versions[c])]

        waiting = still_owed(c for c in versions if c not in self.relayed and self.origin.seen(c))
        if waiting:
            logger.info("diloco: waiting up to %.0f s for %s to fetch the last round", timeout_s, waiting)
        while waiting:
            waiting = still_owed(waiting)
            if not waiting or time.monotonic() >= until:
                break
            if time.monotonic() - probed >= _LINGER_PROBE_S:
                waiting = [c for c in waiting if self.available(c, _LINGER_PROBE_S) is not None]
                probed = time.monotonic()
            time.sleep(self.poll_interval_s)
        if waiting:
            logger.warning("diloco: %s did not fetch the last round within %.0f s", waiting, timeout_s)
        return waiting

    def close(self) -> None:
        self.origin.close()
        if self.relay is not None:
            self.relay.close()
        for d in self._downloaders.values():
            d.close()


@register_store("shardcast")
def shardcast_store(cfg: DilocoConfig, work_dir: Path, secret: bytes | None) -> ShardcastStore:
    """``diloco.store = "shardcast"``: ``ShardcastStore.from_config``."""
    return ShardcastStore.from_config(cfg, work_dir, secret)

"""Publishing payloads from a shardcast origin and fetching peers' payloads, with deadlines.

Each DC serves its own payloads in shardcast's layout (``v<N>/shard_<i>.bin`` and
``distribution.txt`` listing ``v<N>: <blake3>|<num shards>``), and downloads its peers' with
shardcast's client (parallel shard downloads spread over a peer's origin and relays by measured
speed and success rate, blake3-verified). A payload of kind ``grad``/``commit``/``state`` for
round ``r`` is version ``3 r + 1``/``+ 2``/``+ 3``, so a reader knows which version to ask for.

shardcast 0.3.2 is used without patching its files, working around its defects:

- its origin binds 0.0.0.0, has no authentication, serves one request at a time and its
  ``shutdown()`` blocks until a request arrives: the origin here is a threaded ``http.server``
  bound to ``diloco.host`` (127.0.0.1 by default) that requires the run's secret as a bearer
  token on every path but ``/health``, and shardcast's own layout helpers write the files;
- it rewrites ``distribution.txt`` in place (a reader can see half of it): written to a temp
  file and renamed;
- its client probes a ``data1.bin`` the origin never writes, writes ``/tmp/dummy.bin`` (shared by
  every client on a host) and a temp file inside site-packages, shells out to ``wget`` (and runs
  ``apt install wget`` when missing), retries forever, and crashes in ``random.choices`` when
  every server's success rate reaches 0: ``_Downloader`` overrides those methods to fetch
  in-process with ``httpx`` (sending the bearer token), under a deadline, into this DC's own
  download directory, and falls back to uniform server weights.

Downloads use ``httpx`` inside shardcast's downloader rather than ``client.http.EndpointClient``
(which is async and JSON-shaped): shardcast keeps its per-server speed/success weighting and
parallel shards, every attempt is bounded by the round's deadline, and failures come back as
``None`` (data), never as exceptions.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import random
import shutil
import tempfile
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
from shardcast.client import ServerMetrics, ShardDownloader
from shardcast.utils import compute_checksum, get_shard_count, get_shard_filename, update_distribution_file

from prime_composer.diloco.payload import Kind
from prime_composer.io import atomic_write_bytes

logger = logging.getLogger(__name__)
logging.getLogger("shardcast").setLevel(logging.WARNING)  # it logs every shard at INFO

DISTRIBUTION_FILE = "distribution.txt"
SHARD_BYTES = 8 << 20
"""Shard size: big enough to amortise a request, small enough to download several in parallel."""

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
    secret: str | None = None

    def do_GET(self) -> None:
        if self.path == "/health":
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")
            return
        if self.secret is not None:
            scheme, _, token = self.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), self.secret.encode()):
                self.send_error(401, "missing or wrong bearer token")
                return
        if self.path.endswith("/"):
            self.send_error(404)
            return
        super().do_GET()

    def do_HEAD(self) -> None:
        self.send_error(405)

    def list_directory(self, path: Any) -> None:
        self.send_error(404)
        return None

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("origin %s: " + format, self.address_string(), *args)


class Origin:
    """This DC's shardcast origin: writes payloads as shardcast versions and serves them."""

    def __init__(self, directory: Path, host: str, port: int, secret: str | None, keep_versions: int) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep_versions = keep_versions
        self._lock = threading.Lock()
        dist = self.directory / DISTRIBUTION_FILE
        if not dist.exists():
            atomic_write_bytes(dist, b"")
        handler = type("Handler", (_Handler,), {"secret": secret})
        self._server = ThreadingHTTPServer((host, port), partial(handler, directory=str(self.directory)))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="diloco-origin", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def publish(self, kind: Kind, round_: int, data: bytes) -> None:
        """Serve ``data`` as the version of (``kind``, ``round_``); drop the oldest versions."""
        version = version_of(kind, round_)
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
            for old in removed:
                shutil.rmtree(self.directory / old, ignore_errors=True)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


# ------------------------------------------------------------------------------------- client


class _Downloader(ShardDownloader):
    """shardcast's downloader with its defects worked around (see the module docstring)."""

    def __init__(self, servers: list[str], secret: str | None, poll_interval_s: float) -> None:
        # Not super().__init__: it would check for wget (installing it) and probe data1.bin.
        self.servers = [s.rstrip("/") for s in servers]
        self.timeout = 30
        self.metrics_lock = threading.Lock()
        self.server_metrics = {s: ServerMetrics(bandwidth_mbps=1.0, success_rate=1.0) for s in self.servers}
        self.deadline = time.monotonic()
        self.poll_interval_s = poll_interval_s
        headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        self._http = httpx.Client(headers=headers, trust_env=False)

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

    def _wget(self, url: str, output_path: str, timeout: int | None = None) -> bool:
        limit = max(0.05, min(float(timeout or self.timeout), self._remaining()))
        response = self._http.get(url, timeout=limit)
        response.raise_for_status()
        Path(output_path).write_bytes(response.content)
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
            if self._remaining() <= 0:
                return False
            time.sleep(min(self.poll_interval_s, max(0.0, self._remaining())))

    def _download_shard_with_retry(self, url_path: str, output_path: str, shard_index: int) -> str | None:
        return output_path if self.download_file(url_path, output_path) else None

    def get_text(self, url_path: str) -> str | None:
        """One attempt at a small file on any server (the distribution file); None on failure."""
        for server in random.sample(self.servers, len(self.servers)):
            try:
                response = self._http.get(
                    f"{server}/{url_path}", timeout=max(0.05, min(10.0, self._remaining()))
                )
            except httpx.HTTPError:
                continue
            if response.status_code == 200:
                return response.text
        return None

    def close(self) -> None:
        self._http.close()


class ShardcastStore:
    """This DC's origin plus one shardcast client per peer."""

    def __init__(
        self,
        directory: Path,
        host: str,
        port: int,
        peers: dict[str, list[str]],
        secret: str | None,
        keep_rounds: int,
        poll_interval_s: float,
    ) -> None:
        self.directory = Path(directory)
        self.origin = Origin(self.directory / "origin", host, port, secret, keep_versions=3 * keep_rounds)
        self._downloaders = {c: _Downloader(urls, secret, poll_interval_s) for c, urls in peers.items()}
        self._locks = {c: threading.Lock() for c in peers}

    def publish(self, kind: Kind, round_: int, data: bytes) -> None:
        self.origin.publish(kind, round_, data)

    def versions(self, cluster: str, timeout_s: float = 5.0) -> dict[str, tuple[str, int]] | None:
        """The peer's distribution file, or None when it does not answer."""
        downloader = self._downloaders[cluster]
        with self._locks[cluster]:
            downloader.deadline = time.monotonic() + timeout_s
            text = downloader.get_text(DISTRIBUTION_FILE)
        return None if text is None else _parse_distribution(text)

    def available(self, cluster: str, timeout_s: float) -> set[tuple[str, int]] | None:
        """The ``(kind, round)`` pairs the peer serves now, or None when it does not answer."""
        versions = self.versions(cluster, timeout_s)
        if versions is None:
            return None
        out: set[tuple[str, int]] = set()
        for version in versions:
            for kind in _KIND_OFFSET:
                if (r := round_of(version, kind)) is not None:  # type: ignore[arg-type]
                    out.add((kind, r))
        return out

    def fetch(
        self, cluster: str, kind: Kind, round_: int, timeout_s: float, max_bytes: int | None = None
    ) -> bytes | None:
        """The peer's payload of (``kind``, ``round_``) if it is published and downloads (blake3
        checked) within ``timeout_s``; None otherwise (not there yet, peer down, too slow)."""
        version = version_of(kind, round_)
        versions = self.versions(cluster, timeout_s)
        if versions is None or version not in versions:
            return None
        checksum, num_shards = versions[version]
        downloader = self._downloaders[cluster]
        target = self.directory / "downloads" / cluster / version
        shutil.rmtree(target, ignore_errors=True)
        with self._locks[cluster]:
            downloader.deadline = time.monotonic() + timeout_s
            shards = downloader.download_shards(version, num_shards, str(target))
        try:
            if len(shards) != num_shards:
                return None
            whole = target / "payload.bin"
            with open(whole, "wb") as out:
                for i in range(num_shards):
                    out.write((target / get_shard_filename(i)).read_bytes())
            if compute_checksum(str(whole)) != checksum:
                logger.warning("diloco: %s %s from %s fails its blake3 checksum", kind, round_, cluster)
                return None
            return whole.read_bytes()
        finally:
            shutil.rmtree(target, ignore_errors=True)

    def close(self) -> None:
        self.origin.close()
        for d in self._downloaders.values():
            d.close()

"""Published weights over HTTPS, for an inference worker that shares no folder with the trainer.

The trainer side serves its ``broadcasts/`` root (``WeightsOrigin``: the ``step_<N>/`` directories
of ``transport/weights.py``, whole weights or a LoRA adapter alike); a worker on another machine
downloads a step into its own root (``fetch_step``) and loads it with ``load_weights`` as if the
trainer had written it there. Nothing reusable crosses the wire, with the same machinery as the
DiLoCo links (``wire/auth.py``, ``wire/tls.py``, ``wire/fetch.py``):

- every request but ``/health`` is signed with ``HKDF(secret, "prime-composer weights requests
  v1")`` (audience ``weights``, replay window, nonces), and the origin's certificate is pinned;
- a step's ``MANIFEST.json`` (size and SHA-256 of every file) comes with ``MANIFEST.sig``,
  ``HMAC-SHA256(HKDF(secret, "prime-composer weights v1"), "step <N>\\n" + manifest)``, made by
  the origin, which holds the secret. The worker checks the tag before it trusts the manifest
  (so a relay or a proxy in the middle cannot substitute weights, nor serve step 3 as step 5),
  downloads each listed file capped at its listed size, checks its digest, writes the step into
  a hidden directory and renames it into place with its ``STABLE`` marker; ``load_weights`` then
  checks the digests again and the values for finiteness before anything is served.

Routes: ``/health``; ``/latest`` (``{"step": N}``, the newest ``STABLE`` step); ``/step_<N>/<file>``
for ``MANIFEST.json``, ``MANIFEST.sig`` and the files the manifest lists (nothing else).

An inference server uses it through ``inference/weight_updates.py``: given a ``RemoteWeights``,
its ``/update_weights`` fetches the step the orchestrator names into its own root before loading
it, so the orchestrator drives it as it drives a local one.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import shutil
import ssl
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from prime_composer.integrity import MANIFEST_NAME
from prime_composer.io import atomic_write_bytes, atomic_write_text
from prime_composer.wire.auth import AUTH_HEADER, Verifier, hkdf_sha256
from prime_composer.wire.fetch import Peer, TransportError, request
from prime_composer.wire.serve import ServerThread

logger = logging.getLogger(__name__)

STABLE_MARKER = "STABLE"
"""``transport/weights.py``'s marker of a complete step, repeated here so that serving and
fetching import no torch (a download sidecar needs none)."""
_STEP_DIR = re.compile(r"^step_(\d+)$")
AUDIENCE = "weights"
SIGNATURE_NAME = "MANIFEST.sig"
MAX_MANIFEST_BYTES = 1 << 20
_CHUNK = 1 << 20
_PATH = re.compile(r"^/step_(?P<step>\d{1,12})/(?P<name>[A-Za-z0-9_.-]{1,128}(?:/[A-Za-z0-9_.-]{1,128})*)$")


def step_path(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step}"


def latest_stable(root: Path) -> tuple[int, Path] | None:
    """The newest ``step_<N>`` under ``root`` with its ``STABLE`` marker, or None."""
    if not Path(root).is_dir():
        return None
    steps = [
        (int(m.group(1)), p)
        for p in Path(root).iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / STABLE_MARKER).is_file()
    ]
    return max(steps, default=None)


class RemoteWeightsError(Exception):
    """A step that could not be fetched or does not verify; nothing was written in its place."""


def request_key(secret: bytes) -> bytes:
    return hkdf_sha256(secret, b"prime-composer weights requests v1")


def manifest_key(secret: bytes) -> bytes:
    return hkdf_sha256(secret, b"prime-composer weights v1")


def manifest_tag(key: bytes, step: int, manifest: bytes) -> str:
    return hmac.new(key, f"step {step}\n".encode() + manifest, hashlib.sha256).hexdigest()


# ------------------------------------------------------------------------------------- origin


class _Handler(BaseHTTPRequestHandler):
    root: Path
    verifier: Verifier
    key: bytes
    timeout = 30.0

    def setup(self) -> None:
        super().setup()
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send_file(self, path: Path) -> None:
        """``path`` streamed in chunks (weights are GBs: never whole in memory)."""
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            shutil.copyfileobj(f, self.wfile, _CHUNK)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._reply(200, b"ok")
            return
        reason = self.verifier.check("GET", self.path, b"", self.headers.get(AUTH_HEADER))
        if reason is not None:
            self._reply(401, reason.encode())
            return
        if self.path == "/latest":
            newest = latest_stable(self.root)
            self._reply(200, json.dumps({"step": None if newest is None else newest[0]}).encode())
            return
        match = _PATH.match(self.path)
        if match is None or ".." in match["name"].split("/"):
            self._reply(404, b"no such path")
            return
        step, name = int(match["step"]), match["name"]
        directory = step_path(self.root, step)
        try:
            if not (directory / STABLE_MARKER).is_file():
                self._reply(404, b"no such step")
                return
            manifest = (directory / MANIFEST_NAME).read_bytes()
            if name == MANIFEST_NAME:
                self._reply(200, manifest)
            elif name == SIGNATURE_NAME:
                self._reply(200, manifest_tag(self.key, step, manifest).encode())
            elif name in json.loads(manifest)["files"]:
                self._send_file(directory / name)
            else:
                self._reply(404, b"not a file of this step")
        except (OSError, ValueError, KeyError):  # pruned while we read it
            self._reply(404, b"step is gone")

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("weights origin %s: " + format, self.address_string(), *args)


class WeightsOrigin:
    """Serve the published steps under ``root`` (the trainer's ``broadcasts/``) in a thread."""

    def __init__(
        self,
        root: Path,
        host: str,
        port: int,
        secret: bytes,
        *,
        tls: ssl.SSLContext | None = None,
        window_s: float = 120.0,
    ) -> None:
        attrs = {
            "root": Path(root),
            "verifier": Verifier(request_key(secret), AUDIENCE, window_s),
            "key": manifest_key(secret),
        }
        handler = type("Handler", (_Handler,), attrs)
        self._serving = ServerThread(host, port, handler, tls=tls, name="weights-origin")

    @property
    def port(self) -> int:
        return self._serving.port

    def close(self) -> None:
        self._serving.close()


# ------------------------------------------------------------------------------------- worker


def _peer(url: str, fingerprint: str | None, secret: bytes) -> Peer:
    return Peer(url, AUDIENCE, request_key(secret), fingerprint)


def _get(peer: Peer, path: str, deadline: float, max_bytes: int) -> bytes:
    try:
        status, data = request(peer, "GET", path, deadline, max_bytes)
    except TransportError as e:
        raise RemoteWeightsError(f"{peer.url}/{path}: {e}") from None
    if status != 200:
        raise RemoteWeightsError(f"{peer.url}/{path}: HTTP {status} {data[:200].decode('utf-8', 'replace')}")
    return data


def _download(peer: Peer, path: str, deadline: float, size: int, digest: str, target: Path) -> None:
    """``path`` streamed into ``target`` (hashed on the way; never whole in memory), at most
    ``size`` bytes; ``RemoteWeightsError`` (and no file) unless it is exactly the listed file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    sha = hashlib.sha256()
    num_bytes = 0
    try:
        with target.open("wb") as f:

            def sink(chunk: bytes) -> None:
                nonlocal num_bytes
                sha.update(chunk)
                num_bytes += len(chunk)
                f.write(chunk)

            try:
                status, data = request(peer, "GET", path, deadline, size, sink=sink)
            except TransportError as e:
                raise RemoteWeightsError(f"{peer.url}/{path}: {e}") from None
            if status != 200:
                detail = data[:200].decode("utf-8", "replace")
                raise RemoteWeightsError(f"{peer.url}/{path}: HTTP {status} {detail}")
            f.flush()
            os.fsync(f.fileno())
        if num_bytes != size or sha.hexdigest() != digest:
            raise RemoteWeightsError(f"{peer.url}/{path} does not match its manifest")
    except BaseException:
        target.unlink(missing_ok=True)
        raise


def latest_step(url: str, fingerprint: str | None, secret: bytes, timeout_s: float = 10.0) -> int | None:
    """The newest step the origin serves (None: none yet); ``RemoteWeightsError`` if it does not answer."""
    data = _get(_peer(url, fingerprint, secret), "latest", time.monotonic() + timeout_s, 4096)
    try:
        step = json.loads(data)["step"]
    except (ValueError, KeyError, TypeError):
        raise RemoteWeightsError(f"{url}/latest: not a step") from None
    if step is not None and (type(step) is not int or step < 0):
        raise RemoteWeightsError(f"{url}/latest: not a step ({step!r})")
    return step


@dataclass(frozen=True)
class RemoteWeights:
    """Where an inference server fetches published steps from: the trainer side's origin."""

    url: str
    fingerprint: str | None
    secret: bytes = field(repr=False)
    timeout_s: float = 300.0

    def fetch(self, step: int, root: Path) -> Path:
        return fetch_step(self.url, self.fingerprint, self.secret, step, root, self.timeout_s)

    def latest(self) -> int | None:
        return latest_step(self.url, self.fingerprint, self.secret)


def fetch_step(
    url: str,
    fingerprint: str | None,
    secret: bytes,
    step: int,
    root: Path,
    timeout_s: float = 300.0,
    max_bytes: int = 64 << 30,
) -> Path:
    """Download step ``step`` into ``root/step_<step>/`` (see the module docstring) and return it.

    The whole download shares one deadline and at most ``max_bytes``. ``RemoteWeightsError`` if
    the origin does not answer, the manifest's tag or a file's digest does not match, or a file
    is over its listed size; then nothing is left under ``root``."""
    peer = _peer(url, fingerprint, secret)
    deadline = time.monotonic() + timeout_s
    manifest = _get(peer, f"step_{step}/{MANIFEST_NAME}", deadline, MAX_MANIFEST_BYTES)
    tag = _get(peer, f"step_{step}/{SIGNATURE_NAME}", deadline, 64).decode("ascii", "replace")
    if not hmac.compare_digest(tag, manifest_tag(manifest_key(secret), step, manifest)):
        raise RemoteWeightsError(
            f"{url}: the manifest of step {step} is not signed with the run's secret (altered on the way, "
            "another run, or another step served in its place)"
        )
    try:
        files = json.loads(manifest)["files"]
        entries = {str(n): (int(e["bytes"]), str(e["sha256"])) for n, e in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise RemoteWeightsError(f"{url}: the manifest of step {step} is malformed") from None
    if sum(size for size, _ in entries.values()) > max_bytes:
        raise RemoteWeightsError(f"{url}: step {step} lists more than {max_bytes} bytes")
    root = Path(root).resolve()  # an absolute path back (a relative output_dir is the worker's cwd's)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".fetch-step_{step}-", dir=root))
    try:
        for name, (size, digest) in entries.items():
            if not _PATH.match(f"/step_{step}/{name}") or ".." in name.split("/"):
                raise RemoteWeightsError(f"{url}: the manifest of step {step} lists a bad name {name!r}")
            _download(peer, f"step_{step}/{name}", deadline, size, digest, tmp / name)
        atomic_write_bytes(tmp / MANIFEST_NAME, manifest)
        target = step_path(root, step)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_text(target / STABLE_MARKER, json.dumps({"step": step}) + "\n")
    return target


# -------------------------------------------------------------------------------------- command


def main(argv: list[str] | None = None) -> int:
    """``serve`` the trainer side's ``broadcasts/``, or ``fetch`` one step (or the newest) as a worker."""
    import argparse
    import signal
    import sys

    from prime_composer.config.diloco import normalize_fingerprint
    from prime_composer.netaddr import is_loopback
    from prime_composer.wire.tls import fingerprint_of_pem, server_context

    parser = argparse.ArgumentParser(prog="python -m prime_composer.transport.remote", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the published steps under --root (the trainer side)")
    serve.add_argument("--root", type=Path, required=True, help="the trainer's <output_dir>/broadcasts")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=0, help="0 (the default): a free port, printed once ready")
    serve.add_argument("--tls-cert", type=Path)
    serve.add_argument("--tls-key", type=Path)
    serve.add_argument("--private-network", action="store_true", help="allow plain HTTP off loopback")
    fetch = sub.add_parser("fetch", help="download one step into --root (the worker side)")
    fetch.add_argument("--url", required=True, help="https://host:port of the trainer side")
    fetch.add_argument(
        "--fingerprint", help="its certificate's sha256 (from `python -m prime_composer.wire.tls`)"
    )
    fetch.add_argument("--root", type=Path, required=True, help="the worker's own broadcasts root")
    fetch.add_argument("--step", type=int, help="the step (default: the newest)")
    for p in (serve, fetch):
        p.add_argument("--secret-env", required=True, help="environment variable holding the shared secret")
    args = parser.parse_args(argv)
    secret = os.environ.get(args.secret_env, "").encode()
    if not secret:
        print(f"--secret-env {args.secret_env}: that environment variable is unset or empty", file=sys.stderr)
        return 2
    if args.command == "fetch":
        try:
            fingerprint = None if args.fingerprint is None else normalize_fingerprint(args.fingerprint)
            source = RemoteWeights(args.url, fingerprint, secret)
            step = args.step if args.step is not None else source.latest()
            if step is None:
                print(f"{args.url} serves no step yet", file=sys.stderr)
                return 1
            print(source.fetch(step, args.root))
        except (ValueError, RemoteWeightsError) as e:
            print(f"fetch failed: {e}", file=sys.stderr)
            return 1
        return 0
    if (args.tls_cert is None) != (args.tls_key is None):
        print("--tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    if args.tls_cert is None and not is_loopback(args.host) and not args.private_network:
        print(f"--host {args.host}: plain HTTP to other machines needs --private-network", file=sys.stderr)
        return 2
    try:
        tls = None if args.tls_cert is None else server_context(args.tls_cert, args.tls_key)
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return 2
    server = WeightsOrigin(args.root, args.host, args.port, secret, tls=tls)
    pin = f" fingerprint {fingerprint_of_pem(args.tls_cert)}" if args.tls_cert is not None else ""
    print(f"weights origin ready on {args.host}:{server.port}{pin}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

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
for ``MANIFEST.json``, ``MANIFEST.sig``, ``MANIFEST.relay-sig`` and the files the manifest lists
(nothing else).

Workers in another data center go through a ``WeightsRelay`` near them (origin -> relay -> worker,
or a chain origin -> relay -> relay -> worker), started with ``rl relay`` (``launch/relay.py``,
kind ``weights``; this module's older ``relay --flags`` runs that command with the same flags). It
holds ``relay_key(secret)`` only, signs its requests to the origin and checks the requests of its
workers with keys derived from it, checks each step it receives (``MANIFEST.relay-sig``, which the
origin makes with a key derived from the relay key, then every digest) before keeping it, and
serves it on with the origin's ``MANIFEST.sig``, which the workers check as from the origin.
``RemoteWeights(relays=...)`` tries the relays in order, then the origin.

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
RELAY_AUDIENCE = "weights-relay"
SIGNATURE_NAME = "MANIFEST.sig"
RELAY_SIGNATURE_NAME = "MANIFEST.relay-sig"
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


def relay_key(secret: bytes) -> bytes:
    """What a weights relay holds (``python -m prime_composer.transport.remote relay-key``): HKDF
    being one-way, it cannot give back the secret, ``request_key`` or ``manifest_key``."""
    return hkdf_sha256(secret, b"prime-composer weights relay v1")


def relay_request_key(key: bytes) -> bytes:
    """Signs the requests of a hop that involves a relay (worker -> relay, relay -> origin)."""
    return hkdf_sha256(key, b"prime-composer weights relay requests v1")


def relay_manifest_key(key: bytes) -> bytes:
    """Tags a manifest for the relay hop (``MANIFEST.relay-sig``): lets a relay check what it
    receives before it keeps or serves it on. A relay can make this tag, never ``MANIFEST.sig``."""
    return hkdf_sha256(key, b"prime-composer weights relay manifest v1")


# ------------------------------------------------------------------------------------- origin


class _Handler(BaseHTTPRequestHandler):
    root: Path
    verifiers: tuple[Verifier, ...]
    key: bytes
    relay_key: bytes
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

    def _authentic(self) -> bool:
        """Whether the request is signed by one of ``verifiers`` (a 401 sent otherwise)."""
        header = self.headers.get(AUTH_HEADER)
        reasons = []
        for verifier in self.verifiers:
            reason = verifier.check("GET", self.path, b"", header)
            if reason is None:
                return True
            reasons.append(reason)
        # the reason of a verifier whose key signed it (an audience, a replay) says more than the others'
        signed = [r for r in reasons if not r.startswith("bad request signature")]
        self._reply(401, (signed or reasons)[0].encode())
        return False

    def _latest(self) -> bytes:
        newest = latest_stable(self.root)
        return json.dumps({"step": None if newest is None else newest[0]}).encode()

    def _prepare(self, step: int) -> None:
        """Make step ``step`` available under ``root`` (the origin has it or not; a relay fetches it)."""

    def _signature(self, directory: Path, step: int, manifest: bytes) -> bytes:
        return manifest_tag(self.key, step, manifest).encode()

    def do_GET(self) -> None:
        if self.path == "/health":
            self._reply(200, b"ok")
            return
        if not self._authentic():
            return
        try:
            if self.path == "/latest":
                self._reply(200, self._latest())
                return
            match = _PATH.match(self.path)
            if match is None or ".." in match["name"].split("/"):
                self._reply(404, b"no such path")
                return
            step, name = int(match["step"]), match["name"]
            self._prepare(step)
        except RemoteWeightsError as e:  # a relay whose upstream failed or sent what does not verify
            self._reply(502, str(e).encode())
            return
        directory = step_path(self.root, step)
        try:
            if not (directory / STABLE_MARKER).is_file():
                self._reply(404, b"no such step")
                return
            manifest = (directory / MANIFEST_NAME).read_bytes()
            if name == MANIFEST_NAME:
                self._reply(200, manifest)
            elif name == SIGNATURE_NAME:
                self._reply(200, self._signature(directory, step, manifest))
            elif name == RELAY_SIGNATURE_NAME:
                self._reply(200, manifest_tag(relay_manifest_key(self.relay_key), step, manifest).encode())
            elif name in json.loads(manifest)["files"]:
                self._send_file(directory / name)
            else:
                self._reply(404, b"not a file of this step")
        except (OSError, ValueError, KeyError):  # pruned while we read it
            self._reply(404, b"step is gone")

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("weights server %s: " + format, self.address_string(), *args)


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
            # the workers' requests, and those of the relays of the run (``WeightsRelay``)
            "verifiers": (
                Verifier(request_key(secret), AUDIENCE, window_s),
                Verifier(relay_request_key(relay_key(secret)), AUDIENCE, window_s),
            ),
            "key": manifest_key(secret),
            "relay_key": relay_key(secret),
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
    """Where an inference server fetches published steps from: the relays near it, in order, then
    the trainer side's origin. A source that does not answer or sends anything that does not
    verify is logged and the next one is tried; ``RemoteWeightsError`` naming each failure when
    none delivers. Each source gets ``timeout_s``."""

    url: str
    fingerprint: str | None
    secret: bytes = field(repr=False)
    timeout_s: float = 300.0
    relays: tuple[tuple[str, str | None], ...] = ()
    """``(url, fingerprint)`` of each ``WeightsRelay`` to try before the origin."""

    def fetch(self, step: int, root: Path) -> Path:
        failures = []
        for url, fingerprint in self.relays:
            try:
                return fetch_step(url, fingerprint, self.secret, step, root, self.timeout_s, via_relay=True)
            except RemoteWeightsError as e:
                logger.warning("step %d from relay %s failed (%s); trying the next source", step, url, e)
                failures.append(f"relay {e}")
        try:
            return fetch_step(self.url, self.fingerprint, self.secret, step, root, self.timeout_s)
        except RemoteWeightsError as e:
            if not failures:
                raise
            raise RemoteWeightsError("; ".join([*failures, f"origin {e}"])) from None

    def latest(self) -> int | None:
        return latest_step(self.url, self.fingerprint, self.secret)


def _verified_step(
    peer: Peer,
    step: int,
    root: Path,
    deadline: float,
    max_bytes: int,
    tag_name: str,
    tag_key: bytes,
    keep: tuple[str, ...] = (),
) -> Path:
    """Step ``step`` from ``peer`` into ``root/step_<step>/``: the manifest's tag ``tag_name``
    checked with ``tag_key`` first, then every listed file capped at its size and checked against
    its digest; the files named in ``keep`` are stored as received (a relay keeps the end-to-end
    ``MANIFEST.sig`` it cannot make). Written in a hidden directory, renamed in, then ``STABLE``."""
    url = peer.url
    manifest = _get(peer, f"step_{step}/{MANIFEST_NAME}", deadline, MAX_MANIFEST_BYTES)
    tag = _get(peer, f"step_{step}/{tag_name}", deadline, 64).decode("ascii", "replace")
    if not hmac.compare_digest(tag, manifest_tag(tag_key, step, manifest)):
        raise RemoteWeightsError(
            f"{url}: the manifest of step {step} is not signed with the run's secret (altered on the way, "
            "another run, or another step served in its place)"
        )
    kept = {name: _get(peer, f"step_{step}/{name}", deadline, 64) for name in keep}
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
            if not _PATH.match(f"/step_{step}/{name}") or ".." in name.split("/") or name in kept:
                raise RemoteWeightsError(f"{url}: the manifest of step {step} lists a bad name {name!r}")
            _download(peer, f"step_{step}/{name}", deadline, size, digest, tmp / name)
        for name, data in kept.items():
            atomic_write_bytes(tmp / name, data)
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


def fetch_step(
    url: str,
    fingerprint: str | None,
    secret: bytes,
    step: int,
    root: Path,
    timeout_s: float = 300.0,
    max_bytes: int = 64 << 30,
    *,
    via_relay: bool = False,
) -> Path:
    """Download step ``step`` into ``root/step_<step>/`` (see the module docstring) and return it.

    ``via_relay``: ``url`` is a ``WeightsRelay`` (requests signed with the relay hop's key); what
    it serves is checked exactly as the origin's (the end-to-end ``MANIFEST.sig``, which a relay
    cannot make, and every digest). The whole download shares one deadline and at most
    ``max_bytes``. ``RemoteWeightsError`` if the server does not answer, the manifest's tag or a
    file's digest does not match, or a file is over its listed size; then nothing is left under
    ``root``."""
    if via_relay:
        peer = Peer(url, RELAY_AUDIENCE, relay_request_key(relay_key(secret)), fingerprint)
    else:
        peer = _peer(url, fingerprint, secret)
    deadline = time.monotonic() + timeout_s
    return _verified_step(peer, step, root, deadline, max_bytes, SIGNATURE_NAME, manifest_key(secret))


# -------------------------------------------------------------------------------------- relay


class _RelayHandler(_Handler):
    relay: WeightsRelay

    def _latest(self) -> bytes:
        return json.dumps({"step": self.relay.upstream_latest()}).encode()

    def _prepare(self, step: int) -> None:
        self.relay.ensure(step)

    def _signature(self, directory: Path, step: int, manifest: bytes) -> bytes:
        return (directory / SIGNATURE_NAME).read_bytes()  # the origin's, as received


class WeightsRelay:
    """A caching relay of published steps near the workers of another data center.

    It serves the origin's routes to workers (requests signed with the relay hop's key, audience
    ``weights-relay``); the first request for a step fetches the whole step once from the
    ``upstream`` origin (signed, pinned), checks its ``MANIFEST.relay-sig`` and every file's
    digest before keeping it under ``root``, and serves it from there on (with the origin's
    ``MANIFEST.sig`` as received, which the workers check). A step that cannot be fetched or does
    not verify is a 502 naming why, and nothing of it is kept. Holds ``relay_key(secret)`` only:
    it cannot sign a manifest that workers accept. Keeps the newest ``keep_steps`` steps.
    ``upstream_is_relay``: ``upstream`` is another relay, not the origin (relay chains)."""

    def __init__(
        self,
        root: Path,
        host: str,
        port: int,
        key: bytes,
        upstream: str,
        upstream_fingerprint: str | None,
        *,
        tls: ssl.SSLContext | None = None,
        window_s: float = 120.0,
        timeout_s: float = 300.0,
        keep_steps: int = 3,
        max_bytes: int = 64 << 30,
        upstream_is_relay: bool = False,
    ) -> None:
        self.root = Path(root).resolve()
        self.key = key
        # upstream another relay (a chain origin -> relay -> relay -> worker): the same hop key,
        # addressed to that relay's audience; it serves ``MANIFEST.relay-sig`` as the origin does
        audience = RELAY_AUDIENCE if upstream_is_relay else AUDIENCE
        self.upstream = Peer(upstream, audience, relay_request_key(key), upstream_fingerprint)
        self.timeout_s = timeout_s
        self.keep_steps = keep_steps
        self.max_bytes = max_bytes
        self.upstream_fetches = 0
        """Steps fetched from upstream (one per step, whatever the number of workers)."""
        self._locks: dict[int, threading.Lock] = {}
        self._guard = threading.Lock()
        attrs = {
            "root": self.root,
            "verifiers": (Verifier(relay_request_key(key), RELAY_AUDIENCE, window_s),),
            "key": b"",
            "relay_key": key,
            "relay": self,
        }
        handler = type("RelayHandler", (_RelayHandler,), attrs)
        self._serving = ServerThread(host, port, handler, tls=tls, name="weights-relay")

    @property
    def port(self) -> int:
        return self._serving.port

    def upstream_latest(self) -> int | None:
        data = _get(self.upstream, "latest", time.monotonic() + 10.0, 4096)
        try:
            step = json.loads(data)["step"]
        except (ValueError, KeyError, TypeError):
            raise RemoteWeightsError(f"{self.upstream.url}/latest: not a step") from None
        return step if type(step) is int and step >= 0 else None

    def ensure(self, step: int) -> None:
        """Step ``step`` under ``root``, fetched and verified once (concurrent asks wait for it)."""
        with self._guard:
            lock = self._locks.setdefault(step, threading.Lock())
        with lock:
            if (step_path(self.root, step) / STABLE_MARKER).is_file():
                return
            _verified_step(
                self.upstream,
                step,
                self.root,
                time.monotonic() + self.timeout_s,
                self.max_bytes,
                RELAY_SIGNATURE_NAME,
                relay_manifest_key(self.key),
                keep=(SIGNATURE_NAME,),
            )
            self.upstream_fetches += 1
            logger.info("weights relay: step %d fetched from %s", step, self.upstream.url)
        self._prune(step)

    def _prune(self, asked: int) -> None:
        """Drop the oldest steps beyond ``keep_steps``, never ``asked`` (about to be served)."""
        with self._guard:
            steps = sorted(
                (int(m.group(1)), p)
                for p in self.root.iterdir()
                if (m := _STEP_DIR.match(p.name)) and int(m.group(1)) != asked
            )
            for step, path in steps[: max(0, len(steps) + 1 - self.keep_steps)]:
                shutil.rmtree(path, ignore_errors=True)
                self._locks.pop(step, None)

    def close(self) -> None:
        self._serving.close()


# -------------------------------------------------------------------------------------- command


def url_and_pin(value: str) -> tuple[str, str | None]:
    """``https://host:port@sha256:<fp>`` (or ``http://host:port``) as ``(url, normalized pin)``:
    the form of ``inference.weights_origin``, ``weights_relays`` and this command's URLs."""
    from prime_composer.config.diloco import normalize_fingerprint

    url, _, pin = value.partition("@")
    return url, normalize_fingerprint(pin) if pin else None


# The older ``relay`` front-end's flags that ``rl relay`` spells differently; its other flags
# (``--upstream``, ``--keep-steps``, ``--key-env``, ``--host``, ``--port``, ``--tls-cert``,
# ``--tls-key``, ``--private-network``) are ``rl relay``'s keys already.
_OLD_RELAY_FLAGS = {"--root": "--dir", "--upstream-relay": "--upstream-is-relay"}


def _rl_relay_argv(old: list[str]) -> list[str]:
    """The older ``relay --flags`` as ``rl relay`` arguments: ``--kind weights`` and each flag by
    its ``rl relay`` name (``--root X`` is ``--dir X``, ``--upstream-relay`` is
    ``--upstream-is-relay``, ``--flag=value`` forms alike); values pass unchanged."""
    renamed = []
    for token in old:
        name, eq, value = token.partition("=")
        renamed.append(_OLD_RELAY_FLAGS.get(name, name) + eq + value)
    return ["--kind", "weights", *renamed]


def main(argv: list[str] | None = None) -> int:
    """``serve`` the trainer side's ``broadcasts/``, print a relay's ``relay-key``, or ``fetch``
    one step (or the newest) as a worker. ``relay --flags``: the older front-end of the weights
    relay, now ``rl relay --kind weights`` with the same flags (``_rl_relay_argv``)."""
    import argparse
    import signal
    import sys

    from prime_composer.config.diloco import normalize_fingerprint
    from prime_composer.netaddr import is_loopback
    from prime_composer.wire.tls import fingerprint_of_pem, server_context

    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["relay"]:
        # One way to start a relay: this process becomes `rl relay` (launch/relay.py; transport/
        # imports nothing of launch/, so it is run, not imported).
        command = [sys.executable, "-m", "prime_composer.launch.relay", *_rl_relay_argv(args[1:])]
        os.execv(sys.executable, command)
    parser = argparse.ArgumentParser(prog="python -m prime_composer.transport.remote", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the published steps under --root (the trainer side)")
    serve.add_argument("--root", type=Path, required=True, help="the trainer's <output_dir>/broadcasts")
    fetch = sub.add_parser("fetch", help="download one step into --root (the worker side)")
    fetch.add_argument("--url", required=True, help="https://host:port of the trainer side")
    fetch.add_argument(
        "--fingerprint", help="its certificate's sha256 (from `python -m prime_composer.wire.tls`)"
    )
    fetch.add_argument("--root", type=Path, required=True, help="the worker's own broadcasts root")
    fetch.add_argument("--step", type=int, help="the step (default: the newest)")
    fetch.add_argument(
        "--relay",
        action="append",
        default=[],
        help="https://host:port@sha256:<fp> of a weights relay to try first (repeatable, in order)",
    )
    sub.add_parser(
        "relay",
        help="run a weights relay: an alias of `rl relay --kind weights` with the same flags "
        "(--root is its --dir, --upstream-relay its --upstream-is-relay)",
    )
    key = sub.add_parser("relay-key", help="print the key a relay holds (derived from the secret)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=0, help="0 (the default): a free port, printed once ready")
    serve.add_argument("--tls-cert", type=Path)
    serve.add_argument("--tls-key", type=Path)
    serve.add_argument("--private-network", action="store_true", help="allow plain HTTP off loopback")
    for p in (serve, fetch, key):
        p.add_argument("--secret-env", required=True, help="environment variable holding the shared secret")
    parsed = parser.parse_args(args)
    secret = os.environ.get(parsed.secret_env, "").encode()
    if not secret:
        print(
            f"--secret-env {parsed.secret_env}: that environment variable is unset or empty", file=sys.stderr
        )
        return 2
    if parsed.command == "relay-key":
        print(relay_key(secret).hex())
        return 0
    if parsed.command == "fetch":
        try:
            fingerprint = None if parsed.fingerprint is None else normalize_fingerprint(parsed.fingerprint)
            relays = tuple(url_and_pin(r) for r in parsed.relay)
            source = RemoteWeights(parsed.url, fingerprint, secret, relays=relays)
            step = parsed.step if parsed.step is not None else source.latest()
            if step is None:
                print(f"{parsed.url} serves no step yet", file=sys.stderr)
                return 1
            print(source.fetch(step, parsed.root))
        except (ValueError, RemoteWeightsError) as e:
            print(f"fetch failed: {e}", file=sys.stderr)
            return 1
        return 0
    if (parsed.tls_cert is None) != (parsed.tls_key is None):
        print("--tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    if parsed.tls_cert is None and not is_loopback(parsed.host) and not parsed.private_network:
        print(f"--host {parsed.host}: plain HTTP to other machines needs --private-network", file=sys.stderr)
        return 2
    try:
        tls = None if parsed.tls_cert is None else server_context(parsed.tls_cert, parsed.tls_key)
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return 2
    server = WeightsOrigin(parsed.root, parsed.host, parsed.port, secret, tls=tls)
    pin = f" fingerprint {fingerprint_of_pem(parsed.tls_cert)}" if parsed.tls_cert is not None else ""
    print(f"weights origin ready on {parsed.host}:{server.port}{pin}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

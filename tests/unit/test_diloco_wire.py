"""The DiLoCo transport between DCs: signed requests that cannot be replayed, pinned TLS, and
caps that a hostile peer on 127.0.0.1 cannot get past (it trickles, lies in distribution.txt,
or sends 64 MB)."""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from pydantic import ValidationError

from prime_composer.config.diloco import DilocoConfig, PeerConfig
from prime_composer.diloco.shardcast_store import SHARD_BYTES, Origin, ShardcastStore
from prime_composer.wire.auth import AUTH_HEADER, Verifier, hkdf_sha256, sign_request, transport_key
from prime_composer.wire.fetch import Peer, TransportError, request
from prime_composer.wire.tls import fingerprint_of_pem, generate, server_context

SECRET = b"correct horse battery staple"

# ------------------------------------------------------------------------- request signing


def test_hkdf_matches_rfc5869_and_the_transport_key_is_not_the_secret() -> None:
    # RFC 5869, test case 1.
    okm = hkdf_sha256(bytes([0x0B] * 22), bytes(range(0xF0, 0xFA)), 42, salt=bytes(range(0x0D)))
    assert okm.hex() == (
        "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865"
    )
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    expected = HKDF(hashes.SHA256(), 32, None, b"prime-composer diloco transport v1").derive(SECRET)
    key = transport_key(SECRET)
    assert key == expected and key != SECRET and SECRET not in key


def test_a_signed_request_is_accepted_once_and_refused_when_altered_replayed_or_old() -> None:
    key = transport_key(SECRET)
    verifier = Verifier(key, "dc-a", window_s=60)
    header = sign_request(key, "GET", "/v4/shard_00001.bin", b"", "dc-a")
    assert SECRET.decode() not in header and key.hex() not in header
    assert verifier.check("GET", "/v4/shard_00001.bin", b"", header) is None
    assert "replayed" in str(verifier.check("GET", "/v4/shard_00001.bin", b"", header))

    fresh = sign_request(key, "POST", "/publish", b"body", "dc-a")
    assert "signature" in str(verifier.check("POST", "/publish/other", b"body", fresh))  # path
    assert "signature" in str(verifier.check("POST", "/publish", b"bodY", fresh))  # body
    assert "signature" in str(verifier.check("GET", "/publish", b"body", fresh))  # method
    wrong_key = sign_request(transport_key(b"guess"), "GET", "/x", b"", "dc-a")
    assert "signature" in str(verifier.check("GET", "/x", b"", wrong_key))
    to_b = sign_request(key, "GET", "/x", b"", "dc-b")  # captured on its way to another DC
    assert "addressed" in str(verifier.check("GET", "/x", b"", to_b))
    old = sign_request(key, "GET", "/x", b"", "dc-a", now=time.time() - 61)
    assert "timestamp" in str(verifier.check("GET", "/x", b"", old))
    future = sign_request(key, "GET", "/x", b"", "dc-a", now=time.time() + 61)
    assert "timestamp" in str(verifier.check("GET", "/x", b"", future))
    assert "missing" in str(verifier.check("GET", "/x", b"", None))
    assert "malformed" in str(verifier.check("GET", "/x", b"", f"Bearer {SECRET.decode()}"))


@contextmanager
def _recorder() -> Iterator[tuple[int, list[bytes]]]:
    """A server on 127.0.0.1 that records each raw request and answers 200 ``ok``."""
    server = socket.create_server(("127.0.0.1", 0))
    seen: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                seen.append(data)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield int(server.getsockname()[1]), seen
    finally:
        server.close()


def _raw(port: int, data: bytes) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    return int(reply.split(b" ", 2)[1])


def test_the_wire_carries_no_secret_and_a_captured_request_cannot_be_replayed(tmp_path: Path) -> None:
    key = transport_key(SECRET)
    with _recorder() as (port, seen):
        peer = Peer(f"http://127.0.0.1:{port}", "dc-a", key)
        assert request(peer, "GET", "distribution.txt", time.monotonic() + 10, 100) == (200, b"ok")
    (captured,) = seen
    for needle in (SECRET, SECRET.hex().encode(), key, key.hex().encode(), b"Authorization"):
        assert needle not in captured
    assert AUTH_HEADER.encode() in captured

    origin = Origin(tmp_path, "127.0.0.1", 0, SECRET, keep_versions=4, audience="dc-a")
    try:
        # The captured request, sent to the real origin by someone who saw it: once (the original
        # never arrived) it is served; a second time it is refused.
        assert _raw(origin.port, captured) == 200
        assert _raw(origin.port, captured) == 401
        assert _raw(origin.port, b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n") == 200
        bearer = f"GET /distribution.txt HTTP/1.1\r\nAuthorization: Bearer {SECRET.decode()}\r\n"
        assert _raw(origin.port, (bearer + "Connection: close\r\n\r\n").encode()) == 401
    finally:
        origin.close()


# ------------------------------------------------------------------------------- TLS pinning


def test_the_cert_command_writes_a_private_key_and_the_certificates_fingerprint(tmp_path: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    from prime_composer.wire.tls import main

    assert main(["--out", str(tmp_path), "--name", "dc-a", "--host", "10.0.0.1"]) == 0
    assert (tmp_path / "key.pem").stat().st_mode & 0o077 == 0
    cert = x509.load_pem_x509_certificate((tmp_path / "cert.pem").read_bytes())
    assert fingerprint_of_pem(tmp_path / "cert.pem") == "sha256:" + cert.fingerprint(hashes.SHA256()).hex()
    assert main(["--out", str(tmp_path)]) == 2  # an existing key is not overwritten by accident


def _two_stores(tmp_path: Path, pin: str) -> tuple[ShardcastStore, ShardcastStore]:
    fingerprint = generate(tmp_path / "tls-a", "dc-a")
    a = ShardcastStore(
        tmp_path / "a",
        "127.0.0.1",
        0,
        {},
        SECRET,
        4,
        0.05,
        cluster_id="dc-a",
        tls=server_context(tmp_path / "tls-a" / "cert.pem", tmp_path / "tls-a" / "key.pem"),
    )
    url = f"https://127.0.0.1:{a.origin.port}"
    b = ShardcastStore(
        tmp_path / "b",
        "127.0.0.1",
        0,
        {"dc-a": [Peer(url, "dc-a", transport_key(SECRET), fingerprint if pin == "right" else pin)]},
        SECRET,
        4,
        0.05,
        cluster_id="dc-b",
    )
    return a, b


def test_a_pinned_peer_is_fetched_over_tls(tmp_path: Path) -> None:
    a, b = _two_stores(tmp_path, "right")
    try:
        a.publish("grad", 3, b"pseudo-gradient")
        assert b.fetch("dc-a", "grad", 3, timeout_s=10) == b"pseudo-gradient"
    finally:
        a.close(), b.close()


def test_a_certificate_other_than_the_pinned_one_is_refused(tmp_path: Path) -> None:
    a, b = _two_stores(tmp_path, "sha256:" + "00" * 32)
    try:
        a.publish("grad", 3, b"pseudo-gradient")
        assert b.fetch("dc-a", "grad", 3, timeout_s=2) is None
        assert b.transport_errors["pin"] >= 1
        peer = Peer(f"https://127.0.0.1:{a.origin.port}", "dc-a", None, "sha256:" + "11" * 32)
        with pytest.raises(TransportError, match="pinned") as e:
            request(peer, "GET", "health", time.monotonic() + 5, 100)
        assert e.value.reason == "pin"
    finally:
        a.close(), b.close()


# --------------------------------------------------------------------------- transport caps


class _Hostile(BaseHTTPRequestHandler):
    """A peer's origin that answers every request correctly signed or not (it is hostile) with
    what ``behaviour`` says; it counts the shard requests it gets."""

    behaviour = "honest"
    shard_requests = 0
    sent = 0

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        cls = type(self)
        data = b"x" * 1000
        if self.path.partition("?")[0] == "/distribution.txt":  # the query names the sender
            shards = 100_000 if cls.behaviour == "lie" else 1
            checksum = hashlib.sha256(data).hexdigest()  # never checked: nothing gets that far
            body = f"v4: {checksum}|{shards}\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        cls.shard_requests += 1
        self.send_response(200)
        try:
            if cls.behaviour == "trickle":
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                for byte in data:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(0.05)
            elif cls.behaviour == "huge_announced":
                self.send_header("Content-Length", str(64 << 20))
                self.end_headers()
                for _ in range(64):
                    self.wfile.write(b"\0" * (1 << 20))
                    cls.sent += 1 << 20
            elif cls.behaviour == "huge_unannounced":  # no length: read until the server closes
                self.send_header("Connection", "close")
                self.end_headers()
                for _ in range(64):
                    self.wfile.write(b"\0" * (1 << 20))
                    cls.sent += 1 << 20
        except OSError:
            pass


@contextmanager
def _hostile(tmp_path: Path, behaviour: str) -> Iterator[ShardcastStore]:
    handler = type("H", (_Hostile,), {"behaviour": behaviour, "shard_requests": 0, "sent": 0})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    store = ShardcastStore(
        tmp_path,
        "127.0.0.1",
        0,
        {"dc-a": [f"http://127.0.0.1:{server.server_address[1]}"]},
        SECRET,
        4,
        0.05,
        cluster_id="dc-b",
    )
    store.hostile = handler  # type: ignore[attr-defined]
    try:
        yield store
    finally:
        store.close()
        server.shutdown()
        server.server_close()


def test_a_trickling_peer_cannot_stretch_the_deadline(tmp_path: Path) -> None:
    with _hostile(tmp_path, "trickle") as store:
        t0 = time.monotonic()
        assert store.fetch("dc-a", "grad", 1, timeout_s=1.0) is None  # 1000 bytes would take 50 s
        elapsed = time.monotonic() - t0
        assert elapsed < 15, elapsed  # bounded by the 1 s deadline, not by the peer
        assert store.transport_errors["deadline"] >= 1


def test_a_forged_distribution_of_100000_shards_is_refused_without_a_download(tmp_path: Path) -> None:
    with _hostile(tmp_path, "lie") as store:
        for _ in range(3):
            assert store.fetch("dc-a", "grad", 1, timeout_s=1.0, max_bytes=1 << 20) is None
        assert store.hostile.shard_requests == 0  # type: ignore[attr-defined]
        # Without a max_bytes the default cap (MAX_SHARDS) refuses it as well, counted once more.
        assert store.fetch("dc-a", "grad", 1, timeout_s=1.0) is None
        assert store.hostile.shard_requests == 0  # type: ignore[attr-defined]
        assert store.refused == {"too_many_shards": 1}


@pytest.mark.parametrize("behaviour", ["huge_announced", "huge_unannounced"])
def test_64_mb_from_a_peer_is_cut_off_at_max_bytes_and_fetched_once(tmp_path: Path, behaviour: str) -> None:
    with _hostile(tmp_path, behaviour) as store:
        for _ in range(3):
            assert store.fetch("dc-a", "grad", 1, timeout_s=10.0, max_bytes=1 << 20) is None
        hostile = store.hostile  # type: ignore[attr-defined]
        assert hostile.shard_requests == 1  # not again for the same version
        assert store.refused == {"too_large": 1}
        assert store.transport_errors["too_large"] == 1


def test_an_honest_payload_within_its_cap_is_fetched(tmp_path: Path) -> None:
    a = ShardcastStore(tmp_path / "a", "127.0.0.1", 0, {}, SECRET, 4, 0.05, cluster_id="dc-a")
    b = ShardcastStore(
        tmp_path / "b",
        "127.0.0.1",
        0,
        {"dc-a": [f"http://127.0.0.1:{a.origin.port}"]},
        SECRET,
        4,
        0.05,
        cluster_id="dc-b",
    )
    try:
        data = bytes(range(256)) * (SHARD_BYTES // 256 + 7)  # two shards
        a.publish("grad", 2, data)
        assert b.fetch("dc-a", "grad", 2, timeout_s=20, max_bytes=len(data)) == data
        assert b.fetch("dc-a", "grad", 2, timeout_s=20, max_bytes=len(data) - 1) is None
        assert b.refused == {"too_large": 1}
        # Someone else's secret: the origin refuses every request (401), nothing is fetched.
        c = ShardcastStore(
            tmp_path / "c",
            "127.0.0.1",
            0,
            {"dc-a": [f"http://127.0.0.1:{a.origin.port}"]},
            b"another secret",
            4,
            0.05,
        )
        try:
            assert c.fetch("dc-a", "grad", 2, timeout_s=1) is None
            assert c.transport_errors["http_401"] >= 1
        finally:
            c.close()
    finally:
        a.close(), b.close()


# ---------------------------------------------------------------------------- config rules


def _cfg(**fields: object) -> DilocoConfig:
    return DilocoConfig(secret_env="S", **fields)  # type: ignore[arg-type]


def test_plain_http_between_machines_is_refused_unless_the_network_is_private(tmp_path: Path) -> None:
    remote = [PeerConfig(cluster_id="dc-b", urls=["http://198.51.100.20:7701"])]
    with pytest.raises(ValidationError, match="plain HTTP to another machine"):
        _cfg(peers=remote)
    with pytest.raises(ValidationError, match="serves other machines over plain HTTP"):
        _cfg(host="0.0.0.0")
    assert _cfg(peers=remote, host="0.0.0.0", private_network=True).private_network
    # Loopback only (tests, the quickstart): plain HTTP is fine.
    assert _cfg(peers=[PeerConfig(cluster_id="dc-b", urls=["http://127.0.0.1:7702"])])

    fp = "AB:" * 31 + "CD"
    pinned = [PeerConfig(cluster_id="dc-b", urls=["https://198.51.100.20:7701"], fingerprint=fp)]
    cfg = _cfg(peers=pinned, host="0.0.0.0", tls_cert=tmp_path / "c.pem", tls_key=tmp_path / "k.pem")
    assert cfg.peers[0].fingerprint == "sha256:" + "ab" * 31 + "cd"
    with pytest.raises(ValidationError, match="fingerprint is not set"):
        _cfg(peers=[PeerConfig(cluster_id="dc-b", urls=["https://198.51.100.20:7701"])])
    with pytest.raises(ValidationError, match="not a SHA-256 certificate fingerprint"):
        PeerConfig(cluster_id="dc-b", urls=["https://x:1"], fingerprint="sha256:1234")
    with pytest.raises(ValidationError, match=r"tls_cert and diloco\.tls_key go together"):
        _cfg(tls_cert=tmp_path / "c.pem")


def test_torchft_off_loopback_needs_the_private_network_flag() -> None:
    from prime_composer.config.diloco import TorchftConfig

    remote = TorchftConfig(lighthouse="http://10.0.0.5:29510")
    with pytest.raises(ValidationError, match="private network"):
        DilocoConfig(backend="torchft", quantization="none", torchft=remote)
    with pytest.raises(ValidationError, match="private network"):
        DilocoConfig(backend="torchft", quantization="none", host="10.0.0.4", secret_env="S")
    assert DilocoConfig(backend="torchft", quantization="none", torchft=remote, private_network=True)
    assert DilocoConfig(backend="torchft", quantization="none")  # loopback


# ------------------------------------------------------------------------- torchft bind check


def test_the_bind_check_refuses_a_listener_on_every_interface() -> None:
    from prime_composer.diloco.torchft_bind import check_bound, listening_sockets, store_socket

    before = listening_sockets()
    own = store_socket("127.0.0.1", 0)
    try:
        port = own.getsockname()[1]
        assert ("127.0.0.1", port) in {(a, p) for a, p, _ in listening_sockets()}
        check_bound("127.0.0.1", before)  # loopback only: fine
        wildcard = socket.create_server(("0.0.0.0", 0))
        try:
            with pytest.raises(RuntimeError, match=r"listens on 0\.0\.0\.0:\d+, not only on"):
                check_bound("127.0.0.1", before)
        finally:
            wildcard.close()
        six = socket.create_server(("::", 0), family=socket.AF_INET6)
        try:
            with pytest.raises(RuntimeError, match="listens on ::"):
                check_bound("127.0.0.1", before)
        finally:
            six.close()
    finally:
        own.close()

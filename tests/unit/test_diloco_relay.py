"""The relay for DCs behind NAT (``diloco/relay.py``) on loopback: what it stores is sealed (it
cannot forge, alter or move a blob), every route but health needs a signed request, its storage
is bounded and expires by round, and two stores exchange payloads through it over pinned TLS."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

from prime_composer.config.diloco import DilocoConfig, PeerConfig, parse_relay
from prime_composer.diloco.relay import (
    SEAL_OVERHEAD,
    RelayClient,
    RelayServer,
    relay_key,
    seal,
    seal_key,
    unseal,
)
from prime_composer.diloco.shardcast_store import ShardcastStore
from prime_composer.wire.auth import sign_request, transport_key
from prime_composer.wire.fetch import Peer, request
from prime_composer.wire.tls import generate, server_context

SECRET = b"relay-test-secret-0b7e"
FP = "sha256:" + "ab" * 32


def _server(tmp_path: Path, **kw: object) -> RelayServer:
    return RelayServer("127.0.0.1", 0, relay_key(SECRET), tmp_path / "relay", **kw)  # type: ignore[arg-type]


def _call(port: int, method: str, path: str, key: bytes | None, body: bytes = b"") -> int:
    peer = Peer(f"http://127.0.0.1:{port}", "relay", key)
    return request(peer, method, path, time.monotonic() + 5, 1 << 20, body)[0]


def test_a_sealed_blob_opens_only_in_its_slot_and_with_the_secret() -> None:
    key = seal_key(SECRET)
    blob = seal(key, "dc-0", "grad", 3, b"payload bytes")
    assert len(blob) == len(b"payload bytes") + SEAL_OVERHEAD
    assert b"payload bytes" not in blob  # the relay sees ciphertext
    assert unseal(key, "dc-0", "grad", 3, blob) == b"payload bytes"
    flipped = bytearray(blob)
    flipped[-20] ^= 1
    assert unseal(key, "dc-0", "grad", 3, bytes(flipped)) is None  # altered
    assert unseal(key, "dc-0", "grad", 4, blob) is None  # moved to another round
    assert unseal(key, "dc-1", "grad", 3, blob) is None  # or sender
    # What the relay can compute (from its own key) does not make a blob that opens.
    forged = seal(relay_key(SECRET), "dc-0", "grad", 3, b"payload bytes")
    assert unseal(key, "dc-0", "grad", 3, forged) is None
    assert len({relay_key(SECRET), seal_key(SECRET), transport_key(SECRET), SECRET}) == 4


def test_every_route_but_health_needs_a_request_signed_with_the_relay_key(tmp_path: Path) -> None:
    server = _server(tmp_path)
    try:
        assert _call(server.port, "GET", "health", None) == 200
        assert _call(server.port, "GET", "v1/dc-0", None) == 401
        # Signed with the DCs' origin key (not the relay's): refused.
        assert _call(server.port, "GET", "v1/dc-0", transport_key(SECRET)) == 401
        assert _call(server.port, "PUT", "v1/dc-0/grad/0", relay_key(SECRET), b"x") == 200
        assert _call(server.port, "GET", "v1/dc-0", relay_key(SECRET)) == 200
        # The same signed request sent twice: the second is a replay.
        header = sign_request(relay_key(SECRET), "GET", "/v1/dc-0", b"", "relay")
        import http.client

        statuses = []
        for _ in range(2):
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
            conn.request("GET", "/v1/dc-0", headers={"X-Diloco-Auth": header})
            statuses.append(conn.getresponse().status)
            conn.close()
        assert statuses == [200, 401]
    finally:
        server.close()


def test_storage_is_bounded_and_expires_by_round(tmp_path: Path) -> None:
    server = _server(tmp_path, max_blob_bytes=1000, max_total_bytes=2500, max_clusters=2, keep_rounds=2)
    key = relay_key(SECRET)
    try:
        assert _call(server.port, "PUT", "v1/dc-0/grad/0", key, b"x" * 1001) == 413
        assert _call(server.port, "PUT", "v1/dc-0/grad/0", key, b"x" * 1000) == 200
        assert _call(server.port, "PUT", "v1/dc-1/grad/0", key, b"x" * 1000) == 200
        assert _call(server.port, "PUT", "v1/dc-2/grad/0", key, b"x") == 507  # a third sender
        assert _call(server.port, "PUT", "v1/dc-0/commit/0", key, b"x" * 600) == 507  # 2600 > 2500
        for r in range(1, 6):  # rounds older than newest - 2 are deleted as newer ones arrive
            assert _call(server.port, "PUT", f"v1/dc-0/grad/{r}", key, b"y" * 100) == 200
        state = server.state
        assert sorted(state.blobs["dc-0"]) == [("grad", 3), ("grad", 4), ("grad", 5)]
        assert state.total_bytes == 1000 + 300
        assert sorted(p.name for p in (tmp_path / "relay" / "dc-0").iterdir()) == [
            "grad-3.bin",
            "grad-4.bin",
            "grad-5.bin",
        ]
        assert _call(server.port, "PUT", "v1/dc-0/grad/1", key, b"z") == 409  # expired round
        assert _call(server.port, "PUT", "v1/..%2f/grad/1", key, b"z") == 404
    finally:
        server.close()


def test_two_stores_exchange_through_a_pinned_relay_and_a_forged_blob_is_refused_once(tmp_path: Path) -> None:
    pin = generate(tmp_path / "tls", "relay")
    tls = server_context(tmp_path / "tls" / "cert.pem", tmp_path / "tls" / "key.pem")
    server = RelayServer("127.0.0.1", 0, relay_key(SECRET), tmp_path / "relay", tls=tls)
    url = f"https://127.0.0.1:{server.port}"
    stores = [
        ShardcastStore(
            tmp_path / f"dc-{i}",
            "127.0.0.1",
            0,
            {f"dc-{1 - i}": []},
            SECRET,
            keep_rounds=4,
            poll_interval_s=0.05,
            cluster_id=f"dc-{i}",
            relay=RelayClient(url, pin, SECRET),
        )
        for i in range(2)
    ]
    try:
        payload = b"PCDILOCO1\n" + bytes(range(256)) * 40
        stores[0].publish("grad", 2, payload)
        assert stores[1].available("dc-0", 5) == {("grad", 2)}
        assert stores[1].fetch("dc-0", "grad", 2, 5, max_bytes=len(payload)) == payload
        assert stores[1].fetch("dc-0", "grad", 2, 5, max_bytes=len(payload) - 1) is None  # over its cap
        assert stores[0].available("dc-1", 5) == set()
        # The relay (holding only the relay key) replaces dc-0's commit with its own blob.
        forged = seal(relay_key(SECRET), "dc-0", "commit", 2, payload)
        server.state.put("dc-0", "commit", 2, forged)
        assert stores[1].fetch("dc-0", "commit", 2, 5, max_bytes=len(payload)) is None
        assert stores[1].relay is not None and stores[1].relay.errors["bad_seal"] == 1
        assert hashlib.sha256(forged).hexdigest() in stores[1].relay.refused
        assert stores[1].fetch("dc-0", "commit", 2, 5, max_bytes=len(payload)) is None
        assert stores[1].relay.errors["bad_seal"] == 1  # not downloaded again
        # A client pinning another certificate sends nothing.
        wrong = RelayClient(url, FP, SECRET)
        assert wrong.listing("dc-0", 5) is None and wrong.errors == {"pin": 1}
    finally:
        for s in stores:
            s.close()
        server.close()


def test_relay_config_forms_and_errors() -> None:
    assert parse_relay(f"10.0.0.5:7800@{FP}") == ("https://10.0.0.5:7800", FP)
    assert parse_relay("http://127.0.0.1:7800") == ("http://127.0.0.1:7800", None)
    for bad in ("10.0.0.5:7800", "10.0.0.5@" + FP, "10.0.0.5:7800@sha256:12", "http://x"):
        with pytest.raises(ValueError, match=r"diloco\.relay"):
            parse_relay(bad)
    base = {"enabled": True, "secret_env": "S", "peers": [PeerConfig(cluster_id="dc-1")]}
    with pytest.raises(ValueError, match=r"peers\[0\] \(dc-1\)\.urls is empty"):
        DilocoConfig(**base)
    with pytest.raises(ValueError, match="plain HTTP to another machine"):
        DilocoConfig(**base, relay="http://10.0.0.5:7800")
    assert DilocoConfig(**base, relay="http://10.0.0.5:7800", private_network=True).relay
    assert DilocoConfig(**base, relay=f"10.0.0.5:7800@{FP}").relay
    with pytest.raises(ValueError, match="expected 'host:port@sha256"):
        DilocoConfig(**base, relay="10.0.0.5:7800")

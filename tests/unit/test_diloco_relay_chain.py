"""DiLoCo relays in a chain (``diloco/relay.py``, ``upstream``), on loopback over pinned TLS: a DC
behind one relay and a DC behind another exchange payloads both ways, what each relay holds is
the sealed blob its sender made (byte for byte, no payload in the clear), a downstream relay that
pins another certificate sends its upstream nothing, and two relays set as each other's upstream
answer in bounded time (the hop count stops the loop), and an upstream that never answers costs
one listing its time limit, not every listing."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

from prime_composer.config.ports import free_port
from prime_composer.diloco.relay import MAX_HOPS, RelayClient, RelayServer, relay_key
from prime_composer.diloco.shardcast_store import ShardcastStore
from prime_composer.launch.relay import RelayConfig
from prime_composer.wire.tls import generate, server_context

SECRET = b"relay-chain-test-secret-5d21"
PAYLOAD = b"PCDILOCO1\n" + bytes(range(256)) * 64


def _relay(tmp_path: Path, name: str, upstream: tuple[str, str | None] | None = None, port: int = 0):  # type: ignore[no-untyped-def]
    pin = generate(tmp_path / f"tls-{name}", name)
    tls = server_context(tmp_path / f"tls-{name}" / "cert.pem", tmp_path / f"tls-{name}" / "key.pem")
    server = RelayServer(
        "127.0.0.1",
        port,
        relay_key(SECRET),
        tmp_path / name,
        tls=tls,
        upstream=upstream,
        upstream_timeout_s=5,
    )
    return server, f"https://127.0.0.1:{server.port}", pin


def _store(tmp_path: Path, i: int, url: str, pin: str) -> ShardcastStore:
    return ShardcastStore(
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


def _until(condition, timeout_s: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    until = time.monotonic() + timeout_s
    while time.monotonic() < until:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_two_dcs_behind_two_chained_relays_exchange_sealed_blobs_both_ways(tmp_path: Path) -> None:
    top, top_url, top_pin = _relay(tmp_path, "top")
    near, near_url, near_pin = _relay(tmp_path, "near", upstream=(top_url, top_pin))
    stores = [_store(tmp_path, 0, top_url, top_pin), _store(tmp_path, 1, near_url, near_pin)]
    try:
        # dc-1 publishes to the relay near it; it reaches the top relay, where dc-0 reads it.
        stores[1].publish("grad", 3, PAYLOAD)
        assert _until(lambda: ("grad", 3) in top.state.blobs.get("dc-1", {}))
        assert stores[0].available("dc-1", 5) == {("grad", 3)}
        assert stores[0].fetch("dc-1", "grad", 3, 5, max_bytes=len(PAYLOAD)) == PAYLOAD
        # dc-0 publishes to the top relay; dc-1 lists and fetches it through the near one.
        stores[0].publish("commit", 3, PAYLOAD[::-1])
        assert stores[1].available("dc-0", 5) == {("commit", 3)}
        assert stores[1].fetch("dc-0", "commit", 3, 5, max_bytes=len(PAYLOAD)) == PAYLOAD[::-1]
        # Each relay holds the very blob its sender sealed: the same bytes at both, and sealed.
        for cluster, slot in (("dc-1", ("grad", 3)), ("dc-0", ("commit", 3))):
            blobs = [
                (r.directory / cluster / f"{slot[0]}-{slot[1]}.bin").read_bytes()
                for r in (top.state, near.state)
            ]
            assert blobs[0] == blobs[1] and blobs[0].startswith(b"PCSEAL1\n")
            assert PAYLOAD[10:200] not in blobs[0] and PAYLOAD[::-1][:200] not in blobs[0]
            assert top.state.blobs[cluster][slot].sha256 == hashlib.sha256(blobs[0]).hexdigest()
        assert near.upstream is not None and near.upstream.forwarded == 1 and near.upstream.errors == {}
    finally:
        for s in stores:
            s.close()
        near.close()
        top.close()


def test_a_chained_relay_pinning_another_certificate_sends_its_upstream_nothing(tmp_path: Path) -> None:
    top, top_url, _ = _relay(tmp_path, "top")
    wrong = "sha256:" + "ab" * 32
    near, near_url, near_pin = _relay(tmp_path, "near", upstream=(top_url, wrong))
    store = _store(tmp_path, 1, near_url, near_pin)
    try:
        store.publish("grad", 1, PAYLOAD)
        assert near.upstream is not None
        assert _until(lambda: near.upstream.errors.get("pin", 0) >= 1)  # type: ignore[union-attr]
        assert top.state.blobs == {} and near.upstream.forwarded == 0
        assert ("grad", 1) in near.state.blobs["dc-1"]  # its own DCs are still served
    finally:
        store.close()
        near.close()
        top.close()


@pytest.mark.timeout(60)
def test_two_relays_upstream_of_each_other_answer_in_bounded_time(tmp_path: Path) -> None:
    port_b = free_port()
    pin_b = generate(tmp_path / "tls-b", "b")
    a, a_url, a_pin = _relay(tmp_path, "a", upstream=(f"https://127.0.0.1:{port_b}", pin_b))
    b = RelayServer(
        "127.0.0.1",
        port_b,
        relay_key(SECRET),
        tmp_path / "b",
        tls=server_context(tmp_path / "tls-b" / "cert.pem", tmp_path / "tls-b" / "key.pem"),
        upstream=(a_url, a_pin),
        upstream_timeout_s=5,
    )
    client = RelayClient(a_url, a_pin, SECRET)
    try:
        started = time.monotonic()
        assert client.listing("dc-9", 20) == {}  # nobody holds dc-9: the loop ends at MAX_HOPS
        assert client.fetch("dc-9", "grad", 0, 20, 1 << 20) is None
        assert time.monotonic() - started < 15
        assert client.publish("dc-9", "grad", 0, PAYLOAD, 10)
        # The blob goes round the loop until the hop count runs out, then stops.
        assert _until(lambda: a.upstream.forwarded + b.upstream.forwarded >= MAX_HOPS - 1)  # type: ignore[union-attr]
        time.sleep(1.0)
        assert a.upstream.forwarded + b.upstream.forwarded == MAX_HOPS  # type: ignore[union-attr]
    finally:
        b.close()
        a.close()


def test_a_diloco_relay_config_takes_a_pinned_upstream_relay(tmp_path: Path) -> None:
    fp = "sha256:" + "cd" * 32
    base = {"kind": "diloco", "key_env": "K", "dir": tmp_path}
    assert RelayConfig(**base, upstream=f"10.0.0.5:7800@{fp}").upstream  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"relay upstream = '10\.0\.0\.5:7800': expected 'host:port@sha256"):
        RelayConfig(**base, upstream="10.0.0.5:7800")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="plain HTTP off loopback"):
        RelayConfig(**base, upstream="http://10.0.0.5:7800")  # type: ignore[arg-type]
    assert RelayConfig(**base, upstream="http://10.0.0.5:7800", private_network=True).upstream  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="always a relay"):
        RelayConfig(**base, upstream=f"10.0.0.5:7800@{fp}", upstream_is_relay=True)  # type: ignore[arg-type]


def test_an_upstream_that_never_answers_costs_one_listing_its_time_limit(tmp_path: Path) -> None:
    import socket

    silent = socket.create_server(("127.0.0.1", 0))  # accepts connections, never answers
    near = RelayServer(
        "127.0.0.1",
        0,
        relay_key(SECRET),
        tmp_path / "near",
        upstream=(f"http://127.0.0.1:{silent.getsockname()[1]}", None),
        upstream_timeout_s=1.5,
    )
    client = RelayClient(f"http://127.0.0.1:{near.port}", None, SECRET)
    try:
        assert client.publish("dc-1", "grad", 0, PAYLOAD, 10)
        own = near.state.blobs["dc-1"][("grad", 0)].sha256
        started = time.monotonic()
        assert client.listing("dc-1", 10) == {("grad", 0): own}  # its own entries, after the wait
        first = time.monotonic() - started
        started = time.monotonic()
        assert client.listing("dc-1", 10) == {("grad", 0): own}
        assert client.fetch("dc-9", "grad", 0, 10, 1 << 20) is None
        again = time.monotonic() - started
        assert first >= 1.4 and again < 1.0, (first, again)
        assert near.upstream is not None and near.upstream.errors["skipped_down"] == 2
    finally:
        near.close()
        silent.close()

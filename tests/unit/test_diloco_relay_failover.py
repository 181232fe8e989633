"""Several relays (``diloco.relay`` a list, ``relay.RelayGroup``) on loopback: a payload published
reaches every relay; with the first relay gone, a DC behind NAT still publishes and its peer still
lists and fetches through the second, and after one failed call the group asks the second first
(no more failures). Config forms: a list, an empty list refused, each entry checked."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from prime_composer.config.diloco import DilocoConfig, PeerConfig
from prime_composer.diloco.relay import RelayClient, RelayGroup, RelayServer, relay_key
from prime_composer.diloco.shardcast_store import ShardcastStore

SECRET = b"relay-failover-secret-4c1d"


def test_a_dc_behind_nat_trades_through_the_second_relay_when_the_first_is_gone(tmp_path: Path) -> None:
    servers = [RelayServer("127.0.0.1", 0, relay_key(SECRET), tmp_path / f"relay-{i}") for i in range(2)]
    urls = [f"http://127.0.0.1:{s.port}" for s in servers]
    groups = [RelayGroup([RelayClient(u, None, SECRET) for u in urls]) for _ in range(2)]
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
            relay=groups[i],
        )
        for i in range(2)
    ]
    try:
        first = b"PCDILOCO1\n" + bytes(range(256)) * 8
        stores[0].publish("grad", 1, first)
        until = time.monotonic() + 30  # publish returns once one relay has it; the other follows
        while not all(("grad", 1) in (RelayClient(u, None, SECRET).listing("dc-0", 5) or {}) for u in urls):
            assert time.monotonic() < until, "the payload did not reach both relays"
            time.sleep(0.05)
        assert stores[1].fetch("dc-0", "grad", 1, 5, max_bytes=len(first)) == first
        servers[0].close()  # the first relay is gone
        second = first[::-1]
        stores[0].publish("grad", 2, second)
        assert stores[1].available("dc-0", 5) == {("grad", 1), ("grad", 2)}
        failed = sum(groups[1].errors.values())
        assert failed >= 1  # the one call that found the first relay gone
        assert stores[1].fetch("dc-0", "grad", 2, 5, max_bytes=len(second)) == second
        assert stores[1].available("dc-0", 5) is not None
        assert sum(groups[1].errors.values()) == failed  # the second relay is now asked first
    finally:
        for store in stores:
            store.close()
        servers[1].close()


def test_relay_list_config(tmp_path: Path) -> None:
    from prime_composer.config.ports import free_port

    base = {"enabled": True, "secret_env": "S", "peers": [PeerConfig(cluster_id="dc-1")]}
    two = ["http://127.0.0.1:7800", "http://127.0.0.1:7801"]
    assert DilocoConfig(**base, relay=two).relays == two
    assert DilocoConfig(**base, relay="http://127.0.0.1:7800").relays == ["http://127.0.0.1:7800"]
    with pytest.raises(ValueError, match=r"diloco\.relay = \[\]"):
        DilocoConfig(**base, relay=[])
    with pytest.raises(ValueError, match="plain HTTP to another machine"):
        DilocoConfig(**base, relay=["http://127.0.0.1:7800", "http://10.0.0.5:7800"])
    store = ShardcastStore.from_config(
        DilocoConfig(**base, cluster_id="dc-0", relay=two, port=free_port()), tmp_path, SECRET
    )
    try:
        assert isinstance(store.relay, RelayGroup) and len(store.relay.clients) == 2
    finally:
        store.close()

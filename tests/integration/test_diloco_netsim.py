"""The multi-DC harness of ``infra/diloco/netsim.py``: shaped links, a delay proxy, and two toy
DCs that agree bit for bit across namespaces over pinned TLS, while every byte on one DC's link
is recorded: neither the secret, nor the keys derived from it, nor any request in the clear is
on the wire. Needs root; skipped with the reason otherwise."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "infra" / "diloco"))

from netsim import DelayProxy, NetSim, available  # noqa: E402

from prime_composer.config.diloco import DilocoConfig, PeerConfig  # noqa: E402
from prime_composer.diloco.toy import read_log, spawn  # noqa: E402
from prime_composer.wire.auth import transport_key  # noqa: E402
from prime_composer.wire.tls import generate  # noqa: E402

SECRET = "netsim-secret-3f9c1a7be2d64c58a0e1"

pytestmark = [pytest.mark.netns, pytest.mark.skipif(available() is not None, reason=f"netsim {available()}")]


def test_delay_proxy_adds_its_latency_each_way() -> None:
    server = socket.create_server(("127.0.0.1", 0))

    def echo() -> None:
        conn, _ = server.accept()
        while data := conn.recv(1024):
            conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    proxy = DelayProxy(("127.0.0.1", 0), server.getsockname(), delay_ms=100)
    with socket.create_connection(("127.0.0.1", proxy.port)) as client:
        t0 = time.monotonic()
        client.sendall(b"ping")
        assert client.recv(1024) == b"ping"
        rtt = time.monotonic() - t0
    proxy.close()
    server.close()
    assert 0.2 <= rtt < 0.6, rtt  # 100 ms there and 100 ms back


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_dcs_agree_through_shaped_links_with_nothing_to_steal_on_the_wire(tmp_path: Path) -> None:
    pins = [generate(tmp_path / f"tls-{i}", f"dc-{i}") for i in range(2)]
    with NetSim(num_dcs=2, rate_mbit=20) as net:
        configs = [
            DilocoConfig(
                enabled=True,
                cluster_id=f"dc-{i}",
                host=net.address(i),
                port=7801,
                tls_cert=tmp_path / f"tls-{i}" / "cert.pem",
                tls_key=tmp_path / f"tls-{i}" / "key.pem",
                peers=[
                    PeerConfig(
                        cluster_id=f"dc-{1 - i}",
                        urls=[f"https://{net.address(1 - i)}:7801"],
                        fingerprint=pins[1 - i],
                    )
                ],
                secret_env="NETSIM_SECRET",
                sync_every=4,
                num_fragments=2,
                fragment_sync_delay=1,
                quantization="int4",
                round_deadline_s=20.0,
            )
            for i in range(2)
        ]
        capture = net.capture(0, str(tmp_path / "wire.bin"))
        procs = [
            spawn(
                c,
                tmp_path,
                "--steps",
                "17",
                "--width",
                "256",
                env={"NETSIM_SECRET": SECRET},
                prefix=net.prefix(i),
            )
            for i, c in enumerate(configs)
        ]
        try:
            until = time.monotonic() + 240
            while not all(
                (log := read_log(tmp_path / f"{c.cluster_id}.jsonl")) and "done" in log[-1] for c in configs
            ):
                assert time.monotonic() < until, "DCs did not finish"
                assert all(p.poll() is None for p in procs), "a DC exited early"
                time.sleep(0.3)
        finally:
            (tmp_path / "STOP").touch()
            for p in procs:
                p.wait(timeout=30)
            capture.terminate()
            capture.wait(timeout=10)
    wire = (tmp_path / "wire.bin").read_bytes()
    assert len(wire) > 100_000, len(wire)  # the capture saw the payloads go by
    assert b"\x16\x03" in wire  # TLS records
    key = transport_key(SECRET.encode())
    for needle in (SECRET.encode(), key, key.hex().encode(), b"X-Diloco-Auth", b"distribution.txt", b"GET /"):
        assert needle not in wire, needle
    logs = [read_log(tmp_path / f"{c.cluster_id}.jsonl") for c in configs]
    rounds = [{r["round"]: r for r in log if "round" in r} for log in logs]
    assert len(rounds[0]) == 8 and rounds[0].keys() == rounds[1].keys()
    for r in rounds[0]:
        assert rounds[0][r]["members"] == ["dc-0", "dc-1"]
        assert rounds[0][r]["digest"] == rounds[1][r]["digest"]

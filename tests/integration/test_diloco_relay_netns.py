"""A DC behind a firewall that drops every inbound connection trains with a DC on the open
network through the relay (``diloco/relay.py``), in network namespaces (``infra/diloco/netsim.py``):
the relay in its own namespace over pinned TLS, the firewalled DC publishing to it and fetching
its peer's origin directly, the other DC fetching the firewalled DC's payloads from the relay.
The test first checks that an inbound connection to the firewalled DC really fails while an
outbound one works. Needs root and ``iptables``; skipped with the reason otherwise."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "infra" / "diloco"))

from netsim import NetSim, available, block_inbound  # noqa: E402

from prime_composer.config.diloco import DilocoConfig, PeerConfig  # noqa: E402
from prime_composer.diloco.relay import relay_key  # noqa: E402
from prime_composer.diloco.toy import read_log, spawn  # noqa: E402
from prime_composer.wire.tls import generate  # noqa: E402

SECRET = "relay-netns-secret-6d1f0a93"
_REASON = available() or (None if shutil.which("iptables") else "the iptables command is missing")

pytestmark = [pytest.mark.netns, pytest.mark.skipif(_REASON is not None, reason=f"netsim {_REASON}")]

_CONNECT = (
    "import socket,sys\n"
    "try:\n"
    "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close(); print('open')\n"
    "except OSError as e:\n"
    "    print('refused', type(e).__name__)\n"
)
_LISTEN = "import socket,sys,time\ns=socket.create_server((sys.argv[1], int(sys.argv[2])))\ntime.sleep(60)\n"


def _connect(net: NetSim, src: int, dst: int, port: int) -> str:
    out = subprocess.run(
        [*net.prefix(src), sys.executable, "-c", _CONNECT, net.address(dst), str(port)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return out.stdout.strip()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_dc_that_accepts_no_connection_trains_through_the_relay(tmp_path: Path) -> None:
    pins = [generate(tmp_path / f"tls-{name}", name) for name in ("dc-0", "relay")]
    with NetSim(num_dcs=3, rate_mbit=50) as net:  # 0: open DC, 1: firewalled DC, 2: relay
        block_inbound(net, 1)
        listeners = [
            subprocess.Popen([*net.prefix(i), sys.executable, "-c", _LISTEN, net.address(i), "7990"])
            for i in (0, 1)
        ]
        try:
            time.sleep(1.0)
            assert _connect(net, 0, 1, 7990).startswith("refused")  # nothing gets in to DC 1
            assert _connect(net, 1, 0, 7990) == "open"  # DC 1 gets out
            assert _connect(net, 2, 0, 7990) == "open"  # and DC 0 accepts connections
        finally:
            for p in listeners:
                p.kill()
                p.wait()
        relay_log = open(tmp_path / "relay.log", "wb")  # noqa: SIM115
        relay = subprocess.Popen(
            [
                *net.prefix(2),
                sys.executable,
                "-m",
                "prime_composer.launch.relay",  # rl relay
                "--kind",
                "diloco",
                "--host",
                net.address(2),
                "--port",
                "7800",
                "--tls-cert",
                str(tmp_path / "tls-relay" / "cert.pem"),
                "--tls-key",
                str(tmp_path / "tls-relay" / "key.pem"),
                "--key-env",
                "RELAY_KEY",
                "--dir",
                str(tmp_path / "relay-store"),
                "--keep-rounds",
                "20",
            ],
            env={**os.environ, "RELAY_KEY": relay_key(SECRET.encode()).hex()},
            stdout=relay_log,
            stderr=relay_log,
        )
        common = dict(
            enabled=True,
            secret_env="NETSIM_SECRET",
            relay=f"{net.address(2)}:7800@{pins[1]}",
            sync_every=4,
            num_fragments=2,
            fragment_sync_delay=1,
            quantization="int8",
            round_deadline_s=20.0,
        )
        configs = [
            DilocoConfig(  # the open DC: serves its origin, fetches dc-1 from the relay
                cluster_id="dc-0",
                host=net.address(0),
                port=7801,
                tls_cert=tmp_path / "tls-dc-0" / "cert.pem",
                tls_key=tmp_path / "tls-dc-0" / "key.pem",
                peers=[PeerConfig(cluster_id="dc-1")],
                **common,
            ),
            DilocoConfig(  # the firewalled DC: fetches dc-0's origin directly, publishes to the relay
                cluster_id="dc-1",
                peers=[
                    PeerConfig(
                        cluster_id="dc-0", urls=[f"https://{net.address(0)}:7801"], fingerprint=pins[0]
                    )
                ],
                **common,
            ),
        ]
        procs = []
        try:
            until = time.monotonic() + 60
            while b"relay ready" not in (tmp_path / "relay.log").read_bytes():
                assert relay.poll() is None and time.monotonic() < until, (tmp_path / "relay.log").read_text()
                time.sleep(0.1)
            procs = [
                spawn(
                    c,
                    tmp_path,
                    "--steps",
                    "9",
                    "--width",
                    "32",
                    env={"NETSIM_SECRET": SECRET},
                    prefix=net.prefix(i),
                )
                for i, c in enumerate(configs)
            ]
            until = time.monotonic() + 200
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
            relay.terminate()
            relay.wait(timeout=10)
    logs = [read_log(tmp_path / f"{c.cluster_id}.jsonl") for c in configs]
    rounds = [{r["round"]: r for r in log if "round" in r} for log in logs]
    assert sorted(rounds[0]) == [0, 1, 2, 3] and rounds[0].keys() == rounds[1].keys()
    for r in rounds[0]:
        assert rounds[0][r]["members"] == ["dc-0", "dc-1"], rounds[0][r]
        assert rounds[1][r]["members"] == ["dc-0", "dc-1"], rounds[1][r]
        assert rounds[0][r]["digest"] == rounds[1][r]["digest"]
    # dc-1's payloads went through the relay (sealed), dc-0's did too (every DC publishes there).
    stored = {p.parent.name for p in (tmp_path / "relay-store").rglob("*.bin")}
    assert stored == {"dc-0", "dc-1"}
    blob = next((tmp_path / "relay-store" / "dc-1").glob("grad-*.bin")).read_bytes()
    assert blob.startswith(b"PCSEAL1\n") and b"PCDILOCO1" not in blob and b"run_id" not in blob

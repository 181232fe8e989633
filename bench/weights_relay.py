"""Benchmark: published weights to N workers directly from the origin, or through a relay near them.

One origin (``transport/remote.py``, pinned TLS) serves a step of ``--mb`` MB; ``--workers``
workers fetch it, one after another, either each from the origin (``direct``) or through one
``WeightsRelay`` (``relay``: the first worker's request makes the relay fetch and check the step,
the others are served from its cache). Everything runs on 127.0.0.1, so the wall times show what
the relay's extra hop and checks cost in CPU, not what a slow link between data centers costs;
the relay's point is the bytes the origin sends (its egress, counted at the origin's handler),
which is what crosses the internet when the relay sits in the workers' data center. A third phase
fetches directly over plain HTTP to show what TLS costs, and a fourth (``chain``) through two
relays in a row (origin -> relay -> relay -> workers, ``upstream_is_relay``), to show what a second
hop costs. The phases alternate for ``--rounds`` rounds; each is the median. The last line is

    weights_relay_origin_bytes_ratio = origin egress direct / origin egress through the relay
                                       (target: = --workers)

    uv run python bench/weights_relay.py                 # ~1 min on a quiet machine
    uv run python bench/weights_relay.py --mb 256 --workers 8
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from statistics import median

import torch

from prime_composer.transport import remote
from prime_composer.transport.remote import RemoteWeights, WeightsOrigin, WeightsRelay, relay_key
from prime_composer.transport.weights import publish_weights
from prime_composer.wire.tls import generate, server_context

SECRET = b"bench-weights-relay"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=int, default=64, help="size of the published step")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-weights-relay-"))
    served: dict[str, int] = {}
    real_send = remote._Handler._send_file

    def counting_send(self: remote._Handler, path: Path) -> None:  # egress by server kind
        kind = type(self).__name__
        served[kind] = served.get(kind, 0) + path.stat().st_size
        real_send(self, path)

    remote._Handler._send_file = counting_send  # type: ignore[method-assign]
    try:
        numel = args.mb * (1 << 20) // 4
        publish_weights({"w": torch.randn(numel)}, {"model_type": "toy"}, tmp / "broadcasts", 1)
        size = (tmp / "broadcasts" / "step_1" / "model.safetensors").stat().st_size
        pins = {n: generate(tmp / n, n) for n in ("origin", "relay", "relay-2")}
        tls = {n: server_context(tmp / n / "cert.pem", tmp / n / "key.pem") for n in pins}
        origin = WeightsOrigin(tmp / "broadcasts", "127.0.0.1", 0, SECRET, tls=tls["origin"])
        plain = WeightsOrigin(tmp / "broadcasts", "127.0.0.1", 0, SECRET)
        origin_url = f"https://127.0.0.1:{origin.port}"
        walls: dict[str, list[float]] = {"direct": [], "relay": [], "plain": [], "chain": []}
        egress: dict[str, list[int]] = {"direct": [], "relay": [], "chain": []}
        for _ in range(args.rounds):
            for phase in ("direct", "relay", "plain", "chain"):
                relay = second = None
                if phase in ("relay", "chain"):
                    relay = WeightsRelay(
                        tmp / "relay-cache",
                        "127.0.0.1",
                        0,
                        relay_key(SECRET),
                        origin_url,
                        pins["origin"],
                        tls=tls["relay"],
                    )
                    near = (f"https://127.0.0.1:{relay.port}", pins["relay"])
                    if phase == "chain":  # a second relay in front of the first
                        second = WeightsRelay(
                            tmp / "relay-2-cache",
                            "127.0.0.1",
                            0,
                            relay_key(SECRET),
                            *near,
                            tls=tls["relay-2"],
                            upstream_is_relay=True,
                        )
                        near = (f"https://127.0.0.1:{second.port}", pins["relay-2"])
                    source = RemoteWeights(origin_url, pins["origin"], SECRET, relays=(near,))
                elif phase == "direct":
                    source = RemoteWeights(origin_url, pins["origin"], SECRET)
                else:
                    source = RemoteWeights(f"http://127.0.0.1:{plain.port}", None, SECRET)
                served.clear()
                start = time.perf_counter()
                for i in range(args.workers):
                    source.fetch(1, tmp / f"worker-{i}")
                walls[phase].append(time.perf_counter() - start)
                if phase in egress:
                    egress[phase].append(served.get("Handler", 0))
                for server in (relay, second):
                    if server is not None:
                        server.close()
                shutil.rmtree(tmp / "relay-cache", ignore_errors=True)
                shutil.rmtree(tmp / "relay-2-cache", ignore_errors=True)
                for i in range(args.workers):
                    shutil.rmtree(tmp / f"worker-{i}", ignore_errors=True)
        origin.close()
        plain.close()
    finally:
        remote._Handler._send_file = real_send  # type: ignore[method-assign]
        shutil.rmtree(tmp, ignore_errors=True)
    mb = size / 1e6
    for phase, wall in walls.items():
        per = median(wall) / args.workers
        print(
            f"{phase}: {args.workers} workers x {mb:.0f} MB in {median(wall):.2f} s ({mb / per:.0f} MB/s per worker)"
        )
    direct, relayed = median(egress["direct"]), median(egress["relay"])
    chained = median(egress["chain"])
    print(f"origin_egress_mb direct={direct / 1e6:.0f} relay={relayed / 1e6:.0f} chain={chained / 1e6:.0f}")
    print(f"weights_relay_wall_ratio={median(walls['relay']) / median(walls['direct']):.3f}")
    print(f"weights_chain_wall_ratio={median(walls['chain']) / median(walls['relay']):.3f}")
    print(f"weights_tls_wall_ratio={median(walls['direct']) / median(walls['plain']):.3f}")
    print(f"weights_relay_origin_bytes_ratio={direct / relayed:.3f}")


if __name__ == "__main__":
    main()

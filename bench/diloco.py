"""Streaming DiLoCo: bandwidth against DDP, and compute utilisation of 2 DCs on a 20 Mbit/s link.

1. **Bytes sent per inner step.** Baseline, measured in this run: two gloo ranks all-reduce the
   model's fp32 gradient inside a private network namespace, and the namespace's loopback
   counters give the bytes each rank sent per step. DiLoCo: the real payloads (quantized,
   compressed, framed and signed) of a pseudo-gradient after H = 50 AdamW steps, for ``none``,
   ``int8`` and ``int4``; each DC sends its payload once per H steps to each of the N - 1 = 1
   peers, plus the round's commit.
2. **Compute utilisation.** Two toy DCs (``prime_composer.diloco.toy``) in network namespaces
   joined by links shaped with ``tc tbf`` to 20 Mbit/s each way, int4, H = 50, P = 5. Every inner
   step is a real AdamW step of the MLP (forward, backward, optimizer; ``--batch`` rows, one
   thread), timed by the DC itself: utilisation = measured compute time / wall time, from the
   first step to the last, and the table prints the measured step time it divides by. The
   exchange shares the CPU with that compute (quantization, TLS, hashing), as it would on a host.
   Five runs: plain HTTP (``private_network``) without overlap (tau = 0) and with it (tau = 8),
   pinned TLS between the origins (tau = 8), the relay in a third namespace (tau = 8): dc-1
   has no reachable origin, publishes its payloads to the relay and fetches dc-0's origin
   directly; dc-0 fetches dc-1's payloads from the relay; and a chain of two relays (tau = 8):
   dc-1 reaches only a relay in a fourth namespace, which forwards to the relay dc-0 uses and
   fetches through it (each dc-1 payload crosses three links). Next to the payload
   bytes a DC publishes per inner step, the table gives the bytes its interface really sent and
   received (``/proc/net/dev`` in its namespace: headers, TLS records, polling, commits), and what
   the relays sent in all (their namespaces' counters: the chain's extra hop shows there).

Needs root for the namespaces (run under the heavy lock; ~18 minutes on 2 loaded cores):

    flock /tmp/prime-composer-heavy.lock uv run python bench/diloco.py

Last line: ``bytes_reduction=X utilization=Y utilization_tls=Z utilization_relay=W
utilization_chain=V`` (X for int4; Y, Z, W, V with overlap over plain HTTP, TLS, the relay and the
chain of two relays).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "infra" / "diloco"))

from netsim import NetSim, available  # noqa: E402

from prime_composer.config.diloco import DilocoConfig  # noqa: E402
from prime_composer.diloco.payload import encode, grad_body  # noqa: E402
from prime_composer.diloco.quantize import quantize  # noqa: E402
from prime_composer.diloco.relay import relay_key  # noqa: E402
from prime_composer.diloco.toy import make_model, read_log, spawn  # noqa: E402
from prime_composer.wire.tls import fingerprint_of_pem, generate  # noqa: E402

SECRET_ENV = "DILOCO_BENCH_SECRET"


def _counters(prefix: list[str], device: str) -> tuple[int, int]:
    """``(rx_bytes, tx_bytes)`` of ``device`` in the namespace ``prefix`` runs in."""
    text = subprocess.run(
        [*prefix, "cat", "/proc/net/dev"], check=True, capture_output=True, text=True
    ).stdout
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == device:
            fields = rest.split()
            return int(fields[0]), int(fields[8])
    raise RuntimeError(f"no {device} in /proc/net/dev")


def ddp_bytes_per_step(net: NetSim, numel: int, num_steps: int = 5) -> float:
    """Bytes one of 2 gloo ranks sends per fp32 all-reduce of ``numel`` values (measured)."""
    worker = textwrap.dedent(
        f"""
        import os, torch, torch.distributed as dist
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        x = torch.ones({numel})
        dist.barrier()
        for _ in range({num_steps}):
            dist.all_reduce(x)
        dist.barrier()
        dist.destroy_process_group()
        """
    )
    prefix = net.prefix(0)
    before = _counters(prefix, "lo")[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555", "WORLD_SIZE": "2"}
    procs = [
        subprocess.Popen([*prefix, sys.executable, "-c", worker], env={**os.environ, **env, "RANK": str(r)})
        for r in range(2)
    ]
    for p in procs:
        assert p.wait(timeout=300) == 0, "gloo all-reduce failed"
    # Includes the rendezvous and two barriers (a few kB): noise next to megabytes per step.
    return (_counters(prefix, "lo")[1] - before) / 2 / num_steps


def pseudo_gradient(width: int, depth: int, steps: int) -> torch.Tensor:
    """``initial - local`` after ``steps`` AdamW steps of the toy task (a realistic distribution)."""
    model = make_model(width, depth)
    start = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    w_true = torch.randn(width, 1, generator=g)
    for _ in range(steps):
        x = torch.randn(8, width, generator=g)
        loss = (model(x) - torch.tanh(x @ w_true)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return start - torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def payload_bytes(delta: torch.Tensor, quantization: str, block_size: int = 128) -> int:
    fields, body = grad_body(quantize(delta, quantization, block_size), "zlib")  # type: ignore[arg-type]
    header = {
        "run_id": "bench",
        "cluster": "dc-0",
        "kind": "grad",
        "round": 0,
        "fragment": 0,
        "layout": "0" * 64,
    }
    header |= {"num_tokens": 400, "base_digest": "0" * 64, **fields}
    return len(encode(header, body, b"secret"))


MODES = ("http", "tls", "relay", "chain")
"""How the DCs reach each other: plain HTTP on a private network, pinned TLS between their
origins, pinned TLS through the relay (``diloco/relay.py``, in a third namespace), which every
payload then crosses twice (up from its sender, down to its reader), or through two chained relays
(the second in a fourth namespace, dc-1's only way out)."""


def _configs(net: NetSim, root: Path, args: argparse.Namespace, tau: int, mode: str) -> list[DilocoConfig]:
    pins = [generate(root / f"tls-{i}", f"dc-{i}") for i in range(4)] if mode != "http" else []
    configs = []
    for i in range(2):
        other = 1 - i
        fields: dict = {}
        if mode == "http":
            peer = {"cluster_id": f"dc-{other}", "urls": [f"http://{net.address(other)}:7801"]}
            fields["private_network"] = True
        elif mode == "tls":
            peer = {"cluster_id": f"dc-{other}", "urls": [f"https://{net.address(other)}:7801"]}
            peer["fingerprint"] = pins[other]
        else:  # dc-1 has no inbound port: it publishes to the relay, dc-0 fetches it from there
            peer = (
                {"cluster_id": "dc-1"}
                if i == 0
                else {"cluster_id": "dc-0", "urls": [f"https://{net.address(0)}:7801"]}
            )
            if i == 1:
                peer["fingerprint"] = pins[0]
            near = 3 if mode == "chain" and i == 1 else 2  # the chain: dc-1 reaches only relay 3
            fields["relay"] = f"{net.address(near)}:7800@{pins[near]}"
        if mode == "tls" or (mode in ("relay", "chain") and i == 0):
            fields |= {"tls_cert": root / f"tls-{i}" / "cert.pem", "tls_key": root / f"tls-{i}" / "key.pem"}
        configs.append(
            DilocoConfig(
                enabled=True,
                cluster_id=f"dc-{i}",
                host=net.address(i) if mode in ("http", "tls") or i == 0 else "127.0.0.1",
                port=7801,
                peers=[peer],  # type: ignore[list-item]
                secret_env=SECRET_ENV,
                sync_every=args.sync_every,
                num_fragments=args.num_fragments,
                fragment_sync_delay=tau,
                fragment_update_alpha=0.5 if tau else 0.0,
                quantization="int4",
                round_deadline_s=60.0,
                poll_interval_s=0.02,
                **fields,
            )
        )
    return configs


def _start_relay(net: NetSim, root: Path, i: int, upstream: int | None = None) -> subprocess.Popen[bytes]:
    """``rl relay`` (kind ``diloco``) in namespace ``i``, behind the relay of namespace ``upstream``."""
    log_path = root / f"relay-{i}.log"
    log = open(log_path, "wb")  # noqa: SIM115 - the child owns it
    tls = root / f"tls-{i}"
    command = [*net.prefix(i), sys.executable, "-m", "prime_composer.launch.relay", "--kind", "diloco"]
    command += ["--host", net.address(i), "--port", "7800", "--key-env", "RELAY_KEY"]
    command += ["--tls-cert", str(tls / "cert.pem"), "--tls-key", str(tls / "key.pem")]
    command += ["--dir", str(root / f"relay-store-{i}")]
    if upstream is not None:
        pin = fingerprint_of_pem(root / f"tls-{upstream}" / "cert.pem")
        command += ["--upstream", f"{net.address(upstream)}:7800@{pin}"]
    relay = subprocess.Popen(
        command, env={**os.environ, "RELAY_KEY": relay_key(b"bench").hex()}, stdout=log, stderr=log
    )
    until = time.monotonic() + 60
    while b"relay ready" not in log_path.read_bytes():
        if relay.poll() is not None or time.monotonic() > until:
            raise RuntimeError(f"the relay did not start: {log_path.read_text()}")
        time.sleep(0.1)
    return relay


def run_dcs(net: NetSim, root: Path, args: argparse.Namespace, tau: int, mode: str) -> list[dict]:
    """Two toy DCs in their namespaces; their ``done`` records plus interface byte counters."""
    root.mkdir(parents=True)
    configs = _configs(net, root, args, tau, mode)
    relays = [_start_relay(net, root, 2)] if mode in ("relay", "chain") else []
    if mode == "chain":
        relays.append(_start_relay(net, root, 3, upstream=2))
    before = [_counters(net.prefix(i), "eth0") for i in range(4)]
    common = ["--steps", str(args.steps), "--width", str(args.width), "--depth", str(args.depth)]
    common += ["--batch", str(args.batch)]  # no --compute-s: every inner step is real compute
    procs = [
        spawn(c, root, *common, "--seed", str(i + 1), env={SECRET_ENV: "bench"}, prefix=net.prefix(i))
        for i, c in enumerate(configs)
    ]
    try:
        until = time.monotonic() + 600
        while time.monotonic() < until:
            logs = [read_log(root / f"{c.cluster_id}.jsonl") for c in configs]
            if all(log and "done" in log[-1] for log in logs):
                break
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a DC exited early; see {root}/*/stderr.log")
            time.sleep(0.5)
        else:
            raise RuntimeError("the DCs did not finish in 10 minutes")
    finally:
        (root / "STOP").touch()
        for p in procs:
            p.wait(timeout=30)
        for relay in relays:
            relay.terminate()
            relay.wait(timeout=10)
    after = [_counters(net.prefix(i), "eth0") for i in range(4)]
    relay_tx = sum(after[i][1] - before[i][1] for i in (2, 3))  # what the relays sent, all links
    out = []
    for log, b, a in zip(logs, before, after, strict=False):
        rounds = [r for r in log if "round" in r]
        out.append(
            log[-1]
            | {
                "tx_bytes": a[1] - b[1],
                "rx_bytes": a[0] - b[0],
                "round_s": [r["round_s"] for r in rounds],
                "relays_tx_bytes": relay_tx,
            }
        )
    digests = {o["global_digest"] for o in out}
    assert len(digests) == 1, "the two DCs ended with different global weights"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--sync-every", type=int, default=50)
    parser.add_argument("--num-fragments", type=int, default=5)
    parser.add_argument("--overlap", type=int, default=8, help="tau of the overlapped run")
    parser.add_argument("--batch", type=int, default=32, help="rows per inner step (sets the real step time)")
    parser.add_argument("--rate-mbit", type=float, default=20.0)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="links to measure")
    parser.add_argument("--cycles", type=int, default=2, help="H-step cycles per utilisation run")
    args = parser.parse_args()
    reason = available()
    if reason:
        sys.exit(f"bench/diloco.py {reason}")
    torch.set_num_threads(1)
    h = args.sync_every
    numel = sum(p.numel() for p in make_model(args.width, args.depth).parameters())
    print(
        f"model: MLP {args.width} x {args.depth}, {numel / 1e6:.2f}M parameters, fp32 {numel * 4 / 1e6:.1f} MB"
    )

    with NetSim(4, args.rate_mbit) as net:  # the third and fourth namespaces hold the relays
        ddp = ddp_bytes_per_step(net, numel)
        print(f"DDP fp32 all-reduce (gloo, 2 ranks, measured): {ddp / 1e6:.2f} MB sent per rank per step")
        delta = pseudo_gradient(args.width, args.depth, h)
        reductions = {}
        for quantization in ("none", "int8", "int4"):
            per_step = (payload_bytes(delta, quantization) + 600) / h  # + the commit (~600 B)
            reductions[quantization] = ddp / per_step
            print(
                f"DiLoCo {quantization:>4} H={h}: payload {payload_bytes(delta, quantization) / 1e6:.3f} MB, "
                f"{per_step / 1e3:.1f} kB per inner step -> {reductions[quantization]:.0f}x fewer bytes than DDP"
            )

        s = h // args.num_fragments
        # What a DC publishes per inner step: each fragment's int4 grad once per H steps, plus commits.
        payload_per_step = (payload_bytes(delta, "int4") + args.num_fragments * 600) / h
        utilization = {}
        runs = [(0, "http"), *((args.overlap, mode) for mode in MODES)]
        runs = [r for r in runs if r[1] in args.modes]
        print(
            "| link | tau | measured step s | compute s | wall s | utilisation | mean round s | "
            "payload kB/step | wire tx kB/step | wire rx kB/step | wire / payload | relays tx kB/step |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        with tempfile.TemporaryDirectory(prefix="bench-diloco-") as tmp:
            for tau, mode in runs:
                args.steps = args.cycles * h + tau  # ends right after an applied sync
                done = run_dcs(net, Path(tmp) / f"{mode}-tau{tau}", args, tau, mode)
                util = sum(d["compute_s"] for d in done) / sum(d["wall_s"] for d in done)
                utilization[(tau, mode)] = util
                step_s = sum(d["compute_s"] for d in done) / len(done) / args.steps
                sync = sum(sum(d["round_s"]) / len(d["round_s"]) for d in done) / len(done)
                tx = sum(d["tx_bytes"] for d in done) / len(done) / args.steps
                rx = sum(d["rx_bytes"] for d in done) / len(done) / args.steps
                relays = done[0]["relays_tx_bytes"] / args.steps
                print(
                    f"| {mode} | {tau} | {step_s:.4f} | {sum(d['compute_s'] for d in done) / 2:.1f} | "
                    f"{sum(d['wall_s'] for d in done) / 2:.1f} | {util:.3f} | {sync:.2f} | "
                    f"{payload_per_step / 1e3:.1f} | {tx / 1e3:.1f} | {rx / 1e3:.1f} | {tx / payload_per_step:.2f} | "
                    f"{relays / 1e3 if mode in ('relay', 'chain') else 0:.1f} |",
                    flush=True,
                )
                print(
                    json.dumps(
                        {
                            "mode": mode,
                            "tau": tau,
                            "dcs": [{k: v for k, v in d.items() if k != "round_s"} for d in done],
                        }
                    ),
                    file=sys.stderr,
                )
                if tau == 0:
                    print(
                        f"(tau=0: a sync costs {sync:.2f} s against {s * step_s:.2f} s of measured compute between syncs)"
                    )
    o = args.overlap
    parts = [f"bytes_reduction={reductions['int4']:.0f}"]
    names = {
        "http": "utilization",
        "tls": "utilization_tls",
        "relay": "utilization_relay",
        "chain": "utilization_chain",
    }
    for mode, name in names.items():
        if (o, mode) in utilization:
            parts.append(f"{name}={utilization[(o, mode)]:.3f}")
    print(" ".join(parts))


if __name__ == "__main__":
    main()

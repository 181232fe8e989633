"""Streaming DiLoCo: bandwidth against DDP, and compute utilisation of 2 DCs on a 20 Mbit/s link.

1. **Bytes sent per inner step.** Baseline, measured in this run: two gloo ranks all-reduce the
   model's fp32 gradient inside a private network namespace, and the namespace's loopback
   counters give the bytes each rank sent per step. DiLoCo: the real payloads (quantized,
   compressed, framed and signed) of a pseudo-gradient after H = 50 AdamW steps, for ``none``,
   ``int8`` and ``int4``; each DC sends its payload once per H steps to each of the N - 1 = 1
   peers, plus the round's commit.
2. **Compute utilisation.** Two toy DCs (``prime_composer.diloco.toy``) in network namespaces
   joined by links shaped with ``tc tbf`` to 20 Mbit/s each way, int4, H = 50, P = 5; every inner
   step is padded to a fixed compute time (as a GPU step that leaves the CPU to the exchange).
   Utilisation = compute time / wall time, from the first step to the last. Without overlap
   (tau = 0) each sync blocks; with overlap (tau = 8) it runs behind 8 inner steps. The model is
   sized so that one unoverlapped sync costs >= 30% of the compute between syncs (printed).
   The bytes each DC really put on its link are read from its interface counters.

Needs root for the namespaces (run under the heavy lock; ~2 minutes):

    flock /tmp/prime-composer-heavy.lock uv run python bench/diloco.py

Last line: ``bytes_reduction=X utilization=Y`` (X for int4, Y with overlap).
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
from prime_composer.diloco.toy import make_model, read_log, spawn  # noqa: E402

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


def run_dcs(net: NetSim, root: Path, args: argparse.Namespace, tau: int) -> list[dict]:
    """Two toy DCs in their namespaces; their ``done`` records plus interface byte counters."""
    ports = [7801, 7801]
    configs = [
        DilocoConfig(
            enabled=True,
            cluster_id=f"dc-{i}",
            host=net.address(i),
            port=ports[i],
            peers=[{"cluster_id": f"dc-{1 - i}", "urls": [f"http://{net.address(1 - i)}:{ports[1 - i]}"]}],  # type: ignore[list-item]
            secret_env=SECRET_ENV,
            sync_every=args.sync_every,
            num_fragments=args.num_fragments,
            fragment_sync_delay=tau,
            fragment_update_alpha=0.5 if tau else 0.0,
            quantization="int4",
            round_deadline_s=60.0,
            poll_interval_s=0.02,
        )
        for i in range(2)
    ]
    root.mkdir(parents=True)
    before = [_counters(net.prefix(i), "eth0")[1] for i in range(2)]
    common = ["--steps", str(args.steps), "--width", str(args.width), "--depth", str(args.depth)]
    common += ["--compute-s", str(args.compute_s)]
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
    sent = [_counters(net.prefix(i), "eth0")[1] - before[i] for i in range(2)]
    out = []
    for log, tx in zip(logs, sent, strict=True):
        rounds = [r for r in log if "round" in r]
        out.append(log[-1] | {"tx_bytes": tx, "round_s": [r["round_s"] for r in rounds]})
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
    parser.add_argument("--compute-s", type=float, default=0.06, help="compute time of one inner step")
    parser.add_argument("--rate-mbit", type=float, default=20.0)
    parser.add_argument("--cycles", type=int, default=3, help="H-step cycles per utilisation run")
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

    with NetSim(2, args.rate_mbit) as net:
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
        utilization = {}
        with tempfile.TemporaryDirectory(prefix="bench-diloco-") as tmp:
            for tau in (0, args.overlap):
                args.steps = args.cycles * h + tau  # ends right after an applied sync
                done = run_dcs(net, Path(tmp) / f"tau{tau}", args, tau)
                util = sum(d["compute_s"] for d in done) / sum(d["wall_s"] for d in done)
                utilization[tau] = util
                sync = sum(sum(d["round_s"]) / len(d["round_s"]) for d in done) / len(done)
                tx_per_step = sum(d["tx_bytes"] for d in done) / len(done) / args.steps
                print(
                    f"2 DCs at {args.rate_mbit:g} Mbit/s, int4, H={h}, P={args.num_fragments}, tau={tau}: "
                    f"utilisation {util:.3f}; mean sync {sync:.2f} s = {sync / (s * args.compute_s):.0%} of the "
                    f"{s * args.compute_s:.2f} s of compute between syncs; {tx_per_step / 1e3:.1f} kB sent per "
                    f"inner step per DC on the wire ({ddp / tx_per_step:.0f}x below DDP)"
                )
                print(
                    json.dumps(
                        {"tau": tau, "dcs": [{k: v for k, v in d.items() if k != "round_s"} for d in done]}
                    )
                )
    print(f"bytes_reduction={reductions['int4']:.0f} utilization={utilization[args.overlap]:.3f}")


if __name__ == "__main__":
    main()

"""A DC worker with a plain-torch inner loop, for the multi-DC tests, the benchmark and the
network-namespace harness (``infra/diloco/netsim.py``).

Each DC trains an MLP (``--width``, ``--depth``) with AdamW on its own stream of a shared
regression task (the seed differs per DC, the target function does not), runs the outer loop
after every step, and appends one JSON line per applied round to ``--out``: the round, fragment,
members, committer and the SHA-256 of the new global fragment, so a test can check that every
DC ended each round with the same bits. At the end it writes ``{"done": ...}`` with timings and
keeps its origin up until ``--stop-file`` exists (peers may still be fetching from it).

    python -m prime_composer.diloco.toy --config dc-a.json --steps 40 --out dc-a.jsonl

``--die-at-round R`` kills the process (SIGKILL) right after it published round R's payload;
``--step-sleep-s`` stands in for a slower trainer; ``--compute-s`` busy-waits that long per step
(a fixed compute budget per step, so utilisation is measured against a known compute time).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn

from prime_composer.config.diloco import DilocoConfig
from prime_composer.diloco.loop import OuterLoop
from prime_composer.diloco.payload import tensor_digest


def make_model(width: int, depth: int, seed: int = 0) -> nn.Module:
    """The same initial weights in every DC (seed 0), as DiLoCo requires."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, required=True, help="DilocoConfig as JSON")
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=40, help="inner updates to reach")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1, help="data seed of this DC")
    parser.add_argument("--die-at-round", type=int, default=None)
    parser.add_argument("--step-sleep-s", type=float, default=0.0)
    parser.add_argument("--compute-s", type=float, default=0.0)
    parser.add_argument("--stop-file", type=Path, default=None)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    cfg = DilocoConfig.model_validate_json(args.config.read_text())
    model = make_model(args.width, args.depth)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(args.seed)
    target = torch.Generator().manual_seed(1234)
    w_true = torch.randn(args.width, 1, generator=target)

    t_start = time.monotonic()
    outer = OuterLoop(cfg, model, args.work_dir)
    compute_s = 0.0
    step = 0
    with open(args.out, "a") as log:
        log.write(json.dumps({"start": True, "num_updates": outer.num_updates, "pid": os.getpid()}) + "\n")
        log.flush()
        while outer.num_updates < args.steps:
            t0 = time.monotonic()
            x = torch.randn(args.batch, args.width, generator=generator)
            loss = (model(x) - torch.tanh(x @ w_true)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if args.compute_s:
                while time.monotonic() - t0 < args.compute_s:
                    pass
            compute_s += time.monotonic() - t0
            if args.step_sleep_s:
                time.sleep(args.step_sleep_s)
            before = outer.last_result
            outer.after_inner_step(step, args.batch, skipped=False)
            step += 1
            result = outer.last_result
            if result is not None and result is not before:
                f = result.fragment
                record = {
                    "round": result.round,
                    "fragment": f,
                    "members": result.members,
                    "committer": result.committer,
                    "digest": tensor_digest(outer.theta[f]),
                    "loss": float(loss),
                }
                log.write(json.dumps(record) + "\n")
                log.flush()
            pending = outer._pending
            if args.die_at_round is not None and pending is not None and pending[0] == args.die_at_round:
                time.sleep(0.3)  # the payload is out; the round is under way
                os.kill(os.getpid(), signal.SIGKILL)
        wall_s = time.monotonic() - t_start
        done = {
            "done": True,
            "wall_s": wall_s,
            "compute_s": compute_s,
            "num_updates": outer.num_updates,
            "global_digest": outer.global_digest(),
            "rejected": dict(outer.exchange.rejected),
        }
        log.write(json.dumps(done) + "\n")
        log.flush()
    while args.stop_file is not None and not args.stop_file.exists():
        time.sleep(0.1)
    outer.close()


if __name__ == "__main__":
    main()

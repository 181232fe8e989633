"""Benchmark: how much of the rollout/train overlap asynchrony buys, end to end.

Runs the real pipeline (``rl``: inference server, orchestrator and trainer processes) twice on the
same workload, at ``max_async_level`` 0 and 2, and measures the wall time per step of each
(``T0``, ``T2``, from the trainer's metric timestamps, warm-up steps excluded) and the two stage
times of the on-policy run: ``t_rollout`` (the orchestrator waiting for a step's rollouts,
``time/rollout_s``, less the part of it spent waiting for the step's weights) and ``t_train`` (the trainer's step plus publishing the weights,
``time/step_total_s - time/wait_data_s``). On-policy the stages run one after the other, so
``T0 ~ t_rollout + t_train``; perfect overlap would bring a step down to ``max(t_rollout, t_train)``.
The last line is

    overlap_efficiency = (T0 - T2) / (T0 - max(t_rollout, t_train))        (target >= 0.8)

The workload balances the two stages (within a factor of 2; the table says how close): the
arithmetic environment without warm-up or evaluation, dynamic sampling off (every step samples the
same number of rollouts), and a Qwen3 built offline large enough that a train step costs about as
much as a step's rollouts (``--hidden``/``--layers``; rollouts are dominated by per-rollout work
in the orchestrator, train steps by the model). Both sides get one torch thread, so on a 2-core
machine they can really run side by side.

    uv run python bench/async.py                       # ~4 min
    uv run python bench/async.py --hidden 384 --max-steps 12 --keep-outputs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import fmean
from typing import Any

from prime_composer.config.ports import free_port

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "quickstart.toml"


def build_model(args: argparse.Namespace) -> Path:
    from prime_composer.model.tiny import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(
        hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers
    )
    return build_tiny_model(spec)


def run(args: argparse.Namespace, model: Path, level: int, output_dir: Path) -> None:
    rl = Path(sys.executable).parent / "rl"
    command = [
        str(rl),
        "@",
        str(CONFIG),
        "--model.name",
        str(model),
        "--no-warmup.enabled",
        "--max-steps",
        str(args.max_steps),
        "--max-async-level",
        str(level),
        "--output-dir",
        str(output_dir),
        "--inference.port",
        str(free_port("127.0.0.1", set())),
        "--orchestrator.eval.interval",
        "0",
        "--no-orchestrator.advantage.dynamic-sampling",
        "--orchestrator.batch-size",
        str(args.batch_size),
        "--ckpt.interval",
        "0",
        "--no-ckpt.at-end",
        "--launch.overwrite",
        "--no-launch.progress",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(
            f"bench: rl at max_async_level {level} failed:\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}"
        )


def read(output_dir: Path, process: str) -> list[dict[str, Any]]:
    lines = (output_dir / "metrics" / f"{process}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def step_time(output_dir: Path, skip: int) -> float:
    """Mean wall time per step from the trainer's record timestamps, after ``skip`` steps."""
    times = [r["time"] for r in read(output_dir, "trainer")]
    if len(times) < skip + 2:
        raise SystemExit(f"bench: {output_dir} has {len(times)} trainer steps; raise --max-steps")
    return (times[-1] - times[skip]) / (len(times) - 1 - skip)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--skip", type=int, default=2, help="first steps left out (start-up)")
    parser.add_argument("--batch-size", type=int, default=64, help="rollouts per step")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size of the benchmark model")
    parser.add_argument("--layers", type=int, default=6, help="decoder layers of the benchmark model")
    parser.add_argument("--keep-outputs", action="store_true")
    args = parser.parse_args()

    model = build_model(args)
    root = Path(tempfile.mkdtemp(prefix="bench-async-"))
    try:
        outputs = {}
        for level in (0, 2):
            outputs[level] = root / f"async{level}"
            run(args, model, level, outputs[level])
        skip = args.skip
        on_policy_trainer = read(outputs[0], "trainer")[skip:]
        on_policy_orchestrator = read(outputs[0], "orchestrator")[skip:]
        # On-policy the orchestrator's wait for a step's groups includes waiting for its weights.
        t_rollout = fmean(r["time/rollout_s"] - r["time/wait_weights_s"] for r in on_policy_orchestrator)
        t_train = fmean(r["time/step_total_s"] - r["time/wait_data_s"] for r in on_policy_trainer)
        t0, t2 = step_time(outputs[0], skip), step_time(outputs[2], skip)
        lag = fmean(r.get("async/policy_lag", 0.0) for r in read(outputs[2], "orchestrator")[skip:])
        bound = max(t_rollout, t_train)
        balance = max(t_rollout, t_train) / min(t_rollout, t_train)
        load = Path("/proc/loadavg").read_text().split()[:3]
        print(
            f"model hidden {args.hidden} x {args.layers} layers, {args.batch_size} rollouts/step, steps {skip}.., "
            f"load average {' '.join(load)} (3 CPU-bound processes share {os.cpu_count()} cores when overlapping)"
        )
        print(f"{'':28s} {'seconds':>8s}")
        print(f"{'t_rollout (async 0)':28s} {t_rollout:8.2f}")
        print(f"{'t_train (async 0)':28s} {t_train:8.2f}   stages within x{balance:.2f} of each other")
        print(f"{'T0 step, max_async_level 0':28s} {t0:8.2f}")
        print(f"{'T2 step, max_async_level 2':28s} {t2:8.2f}   mean policy lag {lag:.2f}")
        print(f"{'bound max(t_rollout, t_train)':28s} {bound:8.2f}")
        if balance > 2:
            print(
                f"warning: the stages differ by x{balance:.2f} (> 2): adjust --hidden/--layers/--batch-size"
            )
        print(f"overlap_efficiency={(t0 - t2) / (t0 - bound):.3f}")
    finally:
        if args.keep_outputs:
            print(f"outputs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

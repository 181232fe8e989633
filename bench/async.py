"""Benchmark: fraction of wall time the trainer waits for data, at ``max_async_level`` 0, 1 and 2.

Runs the real pipeline (``rl``: SFT warm-up, then inference server, orchestrator and trainer
processes) on ``configs/quickstart.toml``, shrunk to ``--max-steps`` RL steps, once per async
level, one after the other, each in a fresh output directory under a temporary folder and on a
free loopback port. From each run's
``metrics/trainer.jsonl``:

    idle = sum(time/wait_data_s) / sum(time/step_total_s)     over steps 1.. (step 0 waits for
                                                              the first rollouts: start-up, not
                                                              steady state)

``time/wait_data_s`` is the time the trainer blocked in ``receive`` for the step's batch and
``time/step_total_s`` the whole step (wait + train + weight publish). The table also gives the mean
step wall time, which shows the throughput gain of overlap even when the trainer is mostly idle,
and the rollouts generated per step (``samples/generated`` of the orchestrator): dynamic sampling
resamples groups whose rewards are all equal, so a run whose policy scores worse samples more and
waits longer, whatever its async level.
Evaluation is off by default (``--eval-interval 0``): with only a few steps, one evaluation's
extra rollouts would dominate the waits of the step it lands on. The SFT warm-up keeps the
quickstart's length by default: it costs seconds, and a shorter one (e.g. 20 steps) leaves the
reward near 0, so dynamic sampling throws away almost every group and the orchestrator samples
~7x more rollouts per step, which measures the resampling loop rather than the overlap.

The last line is ``idle_async0=A idle_async2=B``. Each run takes ~2-4 min on 2 shared cores
(start-up ~1.5 min: SFT data, model loads, imports).

Run::

    uv run python bench/async.py
    uv run python bench/async.py --levels 0,2 --max-steps 10 --keep-outputs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "quickstart.toml"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rl_command(args: argparse.Namespace, level: int, output_dir: Path) -> list[str]:
    # ``rl`` sits next to the interpreter in the project's virtual environment.
    rl = Path(sys.executable).parent / "rl"
    if not rl.is_file():
        raise SystemExit(f"bench: {rl} not found; run with the project's environment (`uv run python ...`)")
    return [
        str(rl),
        "@",
        str(CONFIG),
        "--max-steps",
        str(args.max_steps),
        "--max-async-level",
        str(level),
        "--output-dir",
        str(output_dir),
        "--inference.port",
        str(free_port()),
        "--orchestrator.eval.interval",
        str(args.eval_interval),
        "--launch.overwrite",
        "--no-launch.progress",
        *([] if args.warmup_steps is None else ["--warmup.max-steps", str(args.warmup_steps)]),
        *args.extra,
    ]


def run_level(args: argparse.Namespace, level: int, root: Path) -> dict[str, Any]:
    """Run the pipeline at one async level; returns the idle fraction and timings."""
    output_dir = root / f"async{level}"
    log_path = root / f"async{level}.log"
    began = time.monotonic()
    with log_path.open("w") as log:
        # Own session: on the way out we can stop rl (which stops its children) and, failing that,
        # its whole process group, without touching anything else.
        proc = subprocess.Popen(
            rl_command(args, level, output_dir),
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            returncode = proc.wait(timeout=args.timeout_s)
        except BaseException:  # timeout, Ctrl-C: never leave the pipeline running
            stop(proc)
            raise
    wall_s = time.monotonic() - began
    if returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-20:])
        raise SystemExit(
            f"bench: rl at max_async_level={level} exited with {returncode}; log {log_path}:\n{tail}"
        )

    rows = [json.loads(line) for line in (output_dir / "metrics" / "trainer.jsonl").read_text().splitlines()]
    steady = [r for r in rows if r["step"] > 0]
    if not steady:
        raise SystemExit(f"bench: no trainer step after step 0 in {output_dir}; raise --max-steps")
    # Rollouts the orchestrator generated per step: dynamic sampling resamples zero-variance
    # groups, so this varies between runs with the reward and explains most of the wait.
    orch = [
        json.loads(line) for line in (output_dir / "metrics" / "orchestrator.jsonl").read_text().splitlines()
    ]
    generated = [r["samples/generated"] for r in orch if r["step"] > 0 and "samples/generated" in r]
    wait_s = sum(r["time/wait_data_s"] for r in steady)
    total_s = sum(r["time/step_total_s"] for r in steady)
    return {
        "level": level,
        "num_steps": len(steady),
        "wait_s": wait_s,
        "total_s": total_s,
        "train_s": sum(r["time/step_s"] for r in steady),
        "idle": wait_s / total_s,
        "mean_step_s": total_s / len(steady),
        "generated_per_step": sum(generated) / max(1, len(generated)),
        "wall_s": wall_s,
    }


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM rl (it stops its children), then SIGKILL its process group if it hangs."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--levels", default="0,1,2", help="comma-separated max_async_level values")
    parser.add_argument("--max-steps", type=int, default=8, help="RL steps per run")
    parser.add_argument(
        "--warmup-steps", type=int, default=None, help="SFT warm-up steps per run (default: the quickstart's)"
    )
    parser.add_argument("--eval-interval", type=int, default=0, help="orchestrator.eval.interval (0 = off)")
    parser.add_argument("--timeout-s", type=float, default=900, help="give up on one run after this long")
    parser.add_argument("--keep-outputs", action="store_true", help="keep the run directories and logs")
    parser.add_argument("extra", nargs="*", help="more rl overrides, after `--`")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",") if x]

    root = Path(tempfile.mkdtemp(prefix="bench-async-"))
    results = []
    try:
        for level in levels:
            result = run_level(args, level, root)
            results.append(result)
            print(
                f"max_async_level={level}: idle {result['idle']:.3f} over {result['num_steps']} steps "
                f"({result['wall_s']:.0f} s)",
                flush=True,
            )
    finally:
        if args.keep_outputs:
            print(f"outputs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)

    print(f"\nquickstart, {args.max_steps} RL steps (step 0 excluded), sums over steps")
    header = f"{'level':>5}{'steps':>6}{'wait s':>9}{'train s':>9}{'total s':>9}{'idle':>7}{'s/step':>8}"
    print(header + f"{'rollouts/step':>14}{'run s':>7}")
    for r in results:
        print(
            f"{r['level']:>5}{r['num_steps']:>6}{r['wait_s']:>9.1f}{r['train_s']:>9.1f}{r['total_s']:>9.1f}"
            f"{r['idle']:>7.3f}{r['mean_step_s']:>8.2f}{r['generated_per_step']:>14.0f}{r['wall_s']:>7.0f}"
        )
    idle = {r["level"]: r["idle"] for r in results}
    print(" ".join(f"idle_async{level}={idle[level]:.3f}" for level in (0, 2) if level in idle))


if __name__ == "__main__":
    main()

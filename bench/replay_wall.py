"""Benchmark: the wall time the trace-replay channel adds to the quickstart, and where it goes.

Runs ``rl @ configs/quickstart.toml`` and ``rl @ configs/quickstart-replay.toml`` one after the
other in one invocation (fresh output directories), then reads both runs' ``metrics/*.jsonl``:

- **warm-up**: from the launch to the start of step 0's rollouts (the replay run fine-tunes and
  serves its teachers and starts the teacher service here; reported apart, as issue 25 asks);
- **RL wall**: from the start of step 0's rollouts to the trainer's last step;
- per step, summed over the run: the orchestrator's ``time/rollout_s`` (waiting for the step's
  rollouts, which includes waiting for the trainer's weights under the async bound),
  ``time/channels_s`` (the channels' ``take``: replay pairs and their reference logprobs),
  ``time/pack_send_s``, and the trainer's ``time/step_s`` (its forward + backward + optimizer) and
  ``time/wait_data_s`` (waiting for the orchestrator's batch);
- ``cpu_s``: CPU seconds of ``rl`` and of every process it started (the whole run, warm-up
  included; on shared cores each one the channel adds is taken from the RL step's processes).

The last line is ``replay_wall_ratio=X``: the replay run's RL wall over the plain run's (target
<= 1.3).

Run::

    uv run python bench/replay_wall.py
    uv run python bench/replay_wall.py --max-steps 20   # both runs shortened the same way
    uv run python bench/replay_wall.py --keep /tmp/wall   # keep both runs' outputs to look into
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SUMS = (
    ("orchestrator", "time/rollout_s"),
    ("orchestrator", "time/wait_weights_s"),
    ("orchestrator", "time/channels_s"),
    ("orchestrator", "time/pack_send_s"),
    ("trainer", "time/step_s"),
    ("trainer", "time/wait_data_s"),
)


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(config: str, out: Path, max_steps: int | None) -> dict[str, float]:
    command = [str(Path(sys.executable).parent / "rl"), "@", config, "--output_dir", str(out)]
    if max_steps is not None:
        command += ["--max_steps", str(max_steps)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.time()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    ended = time.time()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    metrics = {p.stem: read(p) for p in (out / "metrics").glob("*.jsonl")}
    orch = [r for r in metrics["orchestrator"] if "time/rollout_s" in r]
    train = [r for r in metrics["trainer"] if "time/step_s" in r]
    rl_start = orch[0]["time"] - orch[0]["time/rollout_s"]
    result = {
        "total_s": ended - started,
        "warmup_s": rl_start - started,
        "rl_wall_s": train[-1]["time"] - rl_start,
        "steps": len(train),
        # CPU seconds of rl and every process it started and waited for (warm-up included).
        "cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
    }
    for process, key in SUMS:
        rows = orch if process == "orchestrator" else train
        result[f"{process}:{key}"] = sum(r.get(key) or 0.0 for r in rows)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-steps", type=int, default=None, help="override both runs' max_steps")
    parser.add_argument(
        "--keep", type=Path, default=None, help="write both runs under this directory and keep them"
    )
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="pc-replay-wall-") as tmp:
        root = args.keep or Path(tmp)
        for name, config in (
            ("plain", "configs/quickstart.toml"),
            ("replay", "configs/quickstart-replay.toml"),
        ):
            results[name] = run(config, root / name, args.max_steps)
    print("| seconds | plain | replay | replay - plain |")
    print("| --- | --- | --- | --- |")
    for key in results["plain"]:
        a, b = results["plain"][key], results["replay"][key]
        print(f"| {key} | {a:.1f} | {b:.1f} | {b - a:+.1f} |")
    ratio = results["replay"]["rl_wall_s"] / results["plain"]["rl_wall_s"]
    print(f"replay_wall_ratio={ratio:.2f}")


if __name__ == "__main__":
    main()

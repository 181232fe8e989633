"""Several inference replicas through the real launcher: one killed mid-run, the run finishes.

``rl`` starts two ``hf`` replicas of a tiny model (``inference.num_replicas = 2``), the
orchestrator and the trainer; after the first step is logged the test SIGKILLs replica 0's
process. The run must finish every step with the other replica (the launcher reports the lost
one, the pool takes it out), and the metrics must show it: one death, one replica alive, calls on
replica 1 only once the death is recorded, no failed rollout. Plus the launcher's rule for a group of services, with fake
children.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prime_composer.launch.launcher import Launcher
from prime_composer.launch.process import ProcessSpec

REPO = Path(__file__).resolve().parents[2]


def sleeper(name: str, seconds: float, group: str | None = "inference") -> ProcessSpec:
    return ProcessSpec(
        name=name,
        argv=[sys.executable, "-c", f"import time; time.sleep({seconds})"],
        kind="service",
        group=group,
    )


def job(seconds: float) -> ProcessSpec:
    return ProcessSpec(
        name="job", argv=[sys.executable, "-c", f"import time; time.sleep({seconds})"], kind="job"
    )


def test_a_replica_that_exits_does_not_stop_the_run(tmp_path: Path) -> None:
    said: list[str] = []
    launcher = Launcher(
        [sleeper("inference-0", 0.2), sleeper("inference-1", 60), job(2.0)],
        tmp_path,
        poll_s=0.05,
        echo=said.append,
    )
    result = launcher.run()
    assert result.exit_code == 0, result.reason
    assert len(said) == 1 and "inference-0 exited" in said[0] and "goes on" in said[0]


def test_the_last_replica_of_the_group_stops_the_run(tmp_path: Path) -> None:
    launcher = Launcher(
        [sleeper("inference-0", 0.2), sleeper("inference-1", 0.6), job(30.0)],
        tmp_path,
        poll_s=0.05,
        echo=lambda _: None,
    )
    result = launcher.run()
    assert result.exit_code == 1 and result.failed == "inference-1"


def test_a_service_outside_a_group_still_stops_the_run(tmp_path: Path) -> None:
    launcher = Launcher(
        [sleeper("teacher", 0.2, group=None), sleeper("inference-0", 60), job(30.0)],
        tmp_path,
        poll_s=0.05,
        echo=lambda _: None,
    )
    result = launcher.run()
    assert result.exit_code == 1 and result.failed == "teacher"


def _pid_of(config_path: Path) -> int | None:
    """The process running ``-m prime_composer.inference.main @ <config_path>`` (one we started)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(config_path).encode() in argv and b"prime_composer.inference.main" in argv:
            return int(entry.name)
    return None


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics" / "orchestrator.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_two_replicas_one_killed_mid_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    max_steps = 5
    argv = [
        sys.executable,
        "-m",
        "prime_composer.launch.rl",
        "@",
        str(REPO / "configs" / "quickstart.toml"),
        "--output-dir",
        str(out),
        "--max-steps",
        str(max_steps),
        "--warmup.enabled",
        "false",
        "--inference.num-replicas",
        "2",
        "--orchestrator.batch-size",
        "16",
        "--orchestrator.group-size",
        "4",
        "--orchestrator.eval.interval",
        "0",
        "--orchestrator.max-refill-rounds",
        "0",
        "--orchestrator.failure.max-empty-steps",
        str(max_steps + 1),
        "--orchestrator.replicas.retry-s",
        "1",
        "--ckpt.interval",
        "0",
        "--launch.progress",
        "false",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    killed_after = None
    try:
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            if killed_after is None and _metrics(out):
                pid = _pid_of(out / "configs" / "inference-0.json")
                assert pid is not None, "replica 0's process is not running"
                os.killpg(pid, signal.SIGKILL)  # its own process group (the launcher's rule)
                killed_after = len(_metrics(out))
            time.sleep(0.1)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, output[-4000:]
    assert killed_after is not None and killed_after < max_steps, "the run ended before the kill"
    assert "inference-0 exited" in output and "goes on" in output
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(max_steps))
    last = rows[-1]
    assert last["replicas/alive"] == 1 and last["replicas/deaths"] == 1
    # Once a step's metrics record the death, replica 1 alone serves (rollouts run ahead of the
    # step that logs them, so which step that is depends on timing).
    dead_from = next(i for i, r in enumerate(rows) if r["replicas/deaths"] == 1)
    after = rows[dead_from + 1 :]
    # A step whose batch was generated ahead logs no calls at all, so replica 1's calls are summed.
    assert after and all(r["replicas/0/calls"] == 0 for r in after)
    assert sum(r["replicas/1/calls"] for r in rows[dead_from:]) > 0
    # The calls in flight on the killed replica were sent to the other: no rollout failed.
    assert all(r["samples/generated"] > 0 and r["samples/errors"] == 0 for r in rows)
    log = (out / "logs" / "orchestrator.log").read_text()
    assert "inference replica 0" in log and "taken out" in log
    assert (out / "logs" / "inference-0.log").exists() and (out / "logs" / "inference-1.log").exists()

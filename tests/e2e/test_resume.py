"""Kill the trainer with SIGKILL mid-run, resume, and end with the same weights as a run that was
never interrupted (a deterministic CPU config: on-policy, seeded sampling, one sequence at a
time in the server so batching cannot change the numerics)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from prime_composer.transport.weights import load_weights

from .conftest import REPO, metric_steps, rl_command, run_rl

pytestmark = pytest.mark.slow  # more than ~30 s on 2 cores: left out of the fast lane

DETERMINISTIC = (
    "--max-steps",
    "5",
    "--max-async-level",
    "0",
    "--ckpt.interval",
    "2",
    "--orchestrator.sampling.seed",
    "1234",
    "--inference.max-num-seqs",
    "1",
    "--orchestrator.eval.interval",
    "0",
)


def trainer_pid(output_dir: Path) -> int | None:
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"prime_composer.trainer.main" in cmdline and any(str(output_dir).encode() in a for a in cmdline):
            return int(proc.name)
    return None


def test_sigkill_trainer_then_resume_matches_uninterrupted_run(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    proc = run_rl(reference, *DETERMINISTIC)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    out = tmp_path / "interrupted"
    launcher = subprocess.Popen(
        rl_command(out, *DETERMINISTIC), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            metrics = out / "metrics" / "trainer.jsonl"
            if metrics.exists() and len(metric_steps(out, "trainer")) >= 3:  # checkpoint 2 is written
                break
            assert launcher.poll() is None, launcher.communicate()[0]
            time.sleep(0.2)
        pid = trainer_pid(out)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        output, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    assert "trainer exited with code -9" in output
    assert "--resume" in output

    resumed = run_rl(out, *DETERMINISTIC, "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming" in resumed.stdout

    # No step lost or repeated in the logs, and the final weights equal the uninterrupted run's.
    assert metric_steps(out, "trainer") == [0, 1, 2, 3, 4]
    expected = load_weights(reference / "broadcasts" / "step_5")
    actual = load_weights(out / "broadcasts" / "step_5")
    assert expected.keys() == actual.keys()
    max_diff = max((expected[k] - actual[k]).abs().max().item() for k in expected)
    assert max_diff <= 1e-6, max_diff
    # ...and RL did train (nonzero losses), so the comparison is not between untouched models.
    losses = [
        json.loads(line)["loss/total"]
        for line in (reference / "metrics" / "trainer.jsonl").read_text().splitlines()
    ]
    assert any(loss != 0.0 for loss in losses)
    start = load_file(reference / "sft" / "final" / "model.safetensors")
    assert any(not torch.equal(start[k], expected[k]) for k in expected.keys() & start.keys())

"""The shipped SDPO quickstart through the real launcher, shrunk to a few steps: hints are built,
the trainer runs the SDPO term, and the progress lines and metrics show both."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from .conftest import REPO, rl_command

pytestmark = pytest.mark.slow  # more than ~30 s on 2 cores: left out of the fast lane


def test_quickstart_sdpo_runs_end_to_end(tmp_path: Path, quickstart_warmup: Path) -> None:
    out = tmp_path / "run"
    # RL from the quickstart's warm-up, trained once per test run (the quickstart's test runs the
    # warm-up stage itself).
    cmd = rl_command(out, "--max-steps", "3", "--no-warmup.enabled", "--model.name", str(quickstart_warmup))
    config = cmd.index(str(REPO / "configs" / "quickstart.toml"))
    cmd[config] = str(REPO / "configs" / "quickstart-sdpo.toml")
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    trainer = [json.loads(line) for line in (out / "metrics" / "trainer.jsonl").read_text().splitlines()]
    orchestrator = [
        json.loads(line) for line in (out / "metrics" / "orchestrator.jsonl").read_text().splitlines()
    ]
    hinted = [r["sdpo/hinted_fraction"] for r in orchestrator if "sdpo/hinted_fraction" in r]
    assert len(hinted) == 3 and all(0.0 <= h <= 1.0 for h in hinted)
    # The warmed-up tiny model fails often enough that some step has hinted samples, and the trainer
    # then runs the SDPO term on them.
    assert any(h > 0 for h in hinted)
    assert all("loss/sdpo" in r and "loss/rl" in r for r in trainer)
    assert any(r["sdpo/num_tokens"] > 0 and r["loss/sdpo"] > 0 for r in trainer)
    for r in trainer:
        assert abs(r["loss/total"] - (r["loss/rl"] + 0.5 * r["loss/sdpo"])) < 1e-4  # weight 0.5
    assert "sdpo=" in proc.stdout and "hinted=" in proc.stdout
    assert (out / "report.png").stat().st_size > 1000

"""``configs/feature-deletion-smoke.toml`` through the real launcher: the CI corpus is built and
its tasks generated on first use (in a temporary store), then a few RL steps of multi-turn,
tool-using episodes in the environment's sandbox, graded by its grader, trained on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO, free_port, metric_steps

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the environment's sandbox isolates runs only as root"),
]


def test_the_feature_deletion_smoke_config_runs_through_the_launcher(tmp_path: Path) -> None:
    config = (REPO / "configs" / "feature-deletion-smoke.toml").read_text()
    args = 'args = { corpus = "ci", build = true, num_tasks = 4, hidden_paths = ["/work"] }'
    assert args in config
    store = tmp_path / "store"
    config = config.replace(args, args.replace("corpus =", f'store = "{store}", corpus ='))
    (tmp_path / "smoke.toml").write_text(config)
    out = tmp_path / "run"
    command = [sys.executable, "-m", "prime_composer.launch.rl", "@", str(tmp_path / "smoke.toml")]
    command += ["--output-dir", str(out), "--inference.port", str(free_port()), "--no-launch.progress"]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]

    assert (store / "tasks" / "ci" / "tasks.jsonl").is_file()
    assert metric_steps(out, "trainer") == [0, 1, 2]
    rows = [json.loads(line) for line in (out / "metrics" / "orchestrator.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    for row in steps:
        assert row["samples/errors"] == 0  # every episode was played and graded
        assert 0.0 <= row["reward/mean"] <= 1.0
        assert row["env_metric/num_turns"] >= 1.0

"""``configs/feature-deletion-smoke.toml`` through the real launcher: the CI corpus is built and
a few of its tasks generated on first use (in a temporary store), then a few RL steps of multi-turn,
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
    args = 'args = { corpus = "ci", taskset = "ci-smoke", build = true, build_tasks_per_project = 2, num_tasks = 4, hidden_paths = ["/work"] }'
    assert args in config
    store = tmp_path / "store"
    config = config.replace(args, args.replace("corpus =", f'store = "{store}", corpus ='))
    (tmp_path / "smoke.toml").write_text(config)
    out = tmp_path / "run"
    command = [sys.executable, "-m", "prime_composer.launch.rl", "@", str(tmp_path / "smoke.toml")]
    command += ["--output-dir", str(out), "--inference.port", str(free_port()), "--no-launch.progress"]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]

    # Two tasks per project of the CI corpus (textkit, ledger, intervals) and the canary.
    tasks = (store / "tasks" / "ci-smoke" / "tasks.jsonl").read_text().splitlines()
    assert sorted(json.loads(t)["project"] for t in tasks) == sorted(
        ["textkit-0.1.0"] * 2 + ["ledger-0.1.0"] * 2 + ["intervals-0.1.0"] * 2 + ["canary-0"]
    )
    assert metric_steps(out, "trainer") == [0, 1, 2]
    rows = [json.loads(line) for line in (out / "metrics" / "orchestrator.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    for row in steps:
        assert row["samples/errors"] == 0  # every episode was played and graded
        assert 0.0 <= row["reward/mean"] <= 1.0
        assert row["env_metric/num_turns"] >= 1.0

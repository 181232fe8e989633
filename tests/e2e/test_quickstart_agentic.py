"""The agentic quickstart through the real launcher, shrunk to two RL steps: the SFT warm-up on
the oracle's episodes played against the sandbox, then multi-turn tool-using rollouts, training
and evaluation as separate processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO, free_port, metric_steps

pytestmark = pytest.mark.slow


def test_agentic_quickstart_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "prime_composer.launch.rl",
        "@",
        str(REPO / "configs" / "quickstart-agentic.toml"),
        "--output-dir",
        str(out),
        "--inference.port",
        str(free_port()),
        "--no-launch.progress",
        "--max-steps",
        "2",
        # The warm-up is proven by running (its data, a fine-tuned model), not by its quality: 5
        # steps of ~12k tokens each (20 of them took a third of this test's time on 2 cores).
        "--warmup.max-steps",
        "5",
        "--warmup.num-examples",
        "320",
        "--orchestrator.batch-size",
        "16",
        "--orchestrator.group-size",
        "4",
        "--orchestrator.max-refill-rounds",
        "0",
        # One evaluation, after the last step (each one plays the whole eval split's episodes).
        "--orchestrator.eval.interval",
        "2",
        "--no-orchestrator.eval.at-start",
    ]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    # The warm-up data are whole episodes: replies with tool calls and the tools' real answers.
    first = json.loads((out / "sft" / "data.jsonl").read_text().splitlines()[0])
    roles = [m["role"] for m in first["messages"]]
    assert roles.count("assistant") == 5 and roles.count("tool") == 4
    assert any("Exit code: 1" in m["content"] for m in first["messages"] if m["role"] == "tool")

    assert metric_steps(out, "trainer") == [0, 1]
    rows = [json.loads(line) for line in (out / "metrics" / "orchestrator.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [0, 1]
    for row in steps:
        assert row["samples/errors"] == 0  # every episode ran to an end the policy chose or a budget
        assert 0.0 <= row["reward/mean"] <= 1.0
        assert row["env_metric/num_turns"] >= 1.0
        assert "env_metric/agent/num_tool_calls" in row and "env_metric/agent/malformed_calls" in row
    assert any("eval/pyfix/accuracy" in r for r in rows)
    assert (out / "broadcasts" / "step_2" / "STABLE").is_file()

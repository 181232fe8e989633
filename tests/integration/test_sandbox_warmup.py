"""The SFT warm-up refuses to build conversations from reference episodes that fail in the
sandbox (a broken Python environment used to give 2,400 warm-up conversations whose test runs
said ``python: command not found``)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from prime_composer.config.env import AgentLoopConfig
from prime_composer.config.sandbox import SandboxConfig
from prime_composer.orchestrator.agent_task import AgentTaskData, close_sandboxes
from prime_composer.orchestrator.sft_play import play_reference

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="isolated runs need root")


def call(name: str, **arguments: str) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


TASK = AgentTaskData(
    prompt="Make the tests pass.",
    files={"test_ok.py": "def test_ok():\n    assert 1 + 1 == 2\n"},
    tools=["run_tests"],
    test_command="python -m pytest -q -p no:cacheprovider",
    reference_replies=[call("run_tests"), "The tests pass."],
)


def play(config: AgentLoopConfig) -> dict[str, object]:
    try:
        return asyncio.run(play_reference(TASK, config))
    finally:
        close_sandboxes()


def test_a_reference_that_passes_makes_a_conversation() -> None:
    record = play(AgentLoopConfig())
    tool_messages = [m for m in record["messages"] if m["role"] == "tool"]  # type: ignore[index, union-attr]
    assert len(tool_messages) == 1 and "1 passed" in tool_messages[0]["content"]


def test_a_reference_whose_last_test_run_fails_stops_the_warm_up(tmp_path: Path) -> None:
    # A Python environment with no python in it: every test run is `command not found`.
    (tmp_path / "env" / "bin").mkdir(parents=True)
    broken = AgentLoopConfig(sandbox=SandboxConfig(python_env=tmp_path / "env"))
    with pytest.raises(ValueError, match=r"(?s)last test run fails:.*python: command not found"):
        play(broken)

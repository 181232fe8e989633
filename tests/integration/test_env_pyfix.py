"""The pyfix environment on the real sandbox: its splits, that every task's bug shows and its fix
passes, and that the grader only credits the model's calc.py (edited tests, a runner that is made
to pass, a FIFO in place of the file: all 0)."""

from __future__ import annotations

import asyncio
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from prime_composer.config.sandbox import SandboxConfig
from prime_composer.orchestrator.agent_task import AgentState, fresh_workspace
from prime_composer.sandbox import Sandbox, Workspace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "environments" / "pyfix"))

from pyfix.taskset import CASES, FUNCTIONS, MODULE, TEST_FILE, PyfixConfig, PyfixTask, PyfixTaskset


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    with Sandbox(SandboxConfig(allow_unisolated=os.geteuid() != 0)) as sandbox:
        yield sandbox


def tasks(split: str = "train") -> list[PyfixTask]:
    return list(PyfixTaskset(PyfixConfig(id="pyfix", split=split)))  # type: ignore[arg-type]


def test_splits_hold_out_the_last_argument_set() -> None:
    train, held_out = tasks("train"), tasks("eval")
    assert len(train) == len(FUNCTIONS) * (len(CASES) - 1) and len(held_out) == len(FUNCTIONS)
    assert not {t.data.files[TEST_FILE] for t in train} & {t.data.files[TEST_FILE] for t in held_out}
    assert {t.data.function for t in held_out} == {name for name, _, _ in FUNCTIONS}


def grade(sandbox: Sandbox, task: PyfixTask, workspace: Workspace) -> tuple[float, dict]:
    trace = types.SimpleNamespace(state=AgentState(sandbox=sandbox, workspace=workspace), info={})
    return asyncio.run(task.solved(trace)), trace.info  # type: ignore[arg-type]


def graded(sandbox: Sandbox, task: PyfixTask, files: dict[str, str]) -> tuple[float, dict]:
    """The reward of an episode that left ``files`` written over the task's."""
    with fresh_workspace(sandbox, task.data.files, files) as workspace:
        return grade(sandbox, task, workspace)


@pytest.mark.slow
def test_every_bug_shows_and_every_fix_passes(sandbox) -> None:
    for task in tasks("train") + tasks("eval"):
        data = task.data
        reward, info = graded(sandbox, task, {})
        assert reward == 0.0 and info["feedback"]["kind"] == "failing_test"
        assert f"FAIL test_{data.function}" in info["feedback"]["text"]
        assert graded(sandbox, task, {MODULE: data.files[MODULE].replace(data.buggy, data.fixed)})[0] == 1.0
    with sandbox.workspace() as empty:  # no calc.py at all
        assert grade(sandbox, tasks()[0], empty)[0] == 0.0


def test_the_grader_credits_only_calc_py(sandbox) -> None:
    task = tasks()[0]
    # Tests rewritten to pass and the runner replaced: the grader uses its own copies.
    hacked = {TEST_FILE: "def test_nothing():\n    pass\n", "run_tests.py": "print('1 passed, 0 failed')\n"}
    assert graded(sandbox, task, hacked)[0] == 0.0
    # A calc.py that ends the run at import never reports its tests.
    assert graded(sandbox, task, {MODULE: "import sys\nsys.exit(0)\n"})[0] == 0.0
    # A FIFO instead of calc.py is not read (the grader would hang on it) and does not count.
    with fresh_workspace(sandbox, task.data.files, {}) as workspace:
        os.remove(workspace.path / MODULE)
        os.mkfifo(workspace.path / MODULE)
        assert grade(sandbox, task, workspace)[0] == 0.0

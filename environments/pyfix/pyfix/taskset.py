"""Fix a one-line bug in a Python function, with tools, until its tests pass.

Each task is a workspace with ``calc.py`` (one function whose return expression is wrong),
``test_calc.py`` (asserts about it) and ``run_tests.py`` (a small stdlib test runner: pytest
costs ~0.9 s per run here, this ~30 ms, and prints a line per failure instead of a page). The
model gets three tools, ``run_tests``, ``read_file`` and ``edit_file``, and solves a task in four
calls: run the tests (the failing assert shows what is expected), read ``calc.py``, replace the
wrong expression, run the tests again. ``oracle_replies`` writes exactly that episode; it is the
task's ``reference_replies`` (the SFT warm-up plays it against the real tools) and what the
scripted oracle of ``pyfix.scripted`` answers.

Reward ``solved``: 1 when the tests pass on the model's ``calc.py`` copied into a *fresh*
workspace made from the pristine task files (so edited tests, extra files or a rewritten runner
do not count) and the runner reports every test run; else 0, with the test output left as
environment feedback (``trace.info["feedback"]``, kind ``failing_test``) for SDPO hints. Metric
``edited`` says whether ``calc.py`` changed at all.

Tasks: ``FUNCTIONS`` (ten functions of ``a`` and ``b``) x ``CASES`` (argument sets); the eval
split holds out the last argument set of every function, so it checks that the fix does not
depend on the numbers in the test.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import verifiers.v1 as vf
from pydantic import Field

from prime_composer.orchestrator.agent_task import AgentState, AgentTaskData, fresh_workspace, read_files

FUNCTIONS: tuple[tuple[str, str, str], ...] = (
    ("add", "a + b", "a - b"),
    ("sub", "a - b", "a + b"),
    ("mul", "a * b", "a + b"),
    ("power", "a ** b", "a * b"),
    ("floordiv", "a // b", "a % b"),
    ("mod", "a % b", "a // b"),
    ("maximum", "max(a, b)", "min(a, b)"),
    ("minimum", "min(a, b)", "max(a, b)"),
    ("distance", "abs(a - b)", "a - b"),
    ("average", "(a + b) // 2", "(a + b) % 2"),
)
"""``(name, correct expression, buggy expression)``."""

CASES: tuple[tuple[tuple[int, int], tuple[int, int]], ...] = (
    ((2, 3), (4, 6)),
    ((3, 5), (1, 4)),
    ((2, 7), (6, 8)),
    ((3, 4), (2, 9)),
)
"""Argument pairs of the two asserts of a task's test (``a < b``, so every bug shows)."""

MODULE, TEST_FILE, RUNNER = "calc.py", "test_calc.py", "run_tests.py"
TEST_COMMAND = f"python {RUNNER}"
TOOLS = ["run_tests", "read_file", "edit_file"]

SYSTEM_PROMPT = (
    "You fix Python code. Tools: run_tests(), read_file(path), edit_file(path, old_string, new_string). "
    'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>. Reply without a call when done.'
)

RUNNER_SOURCE = '''"""Run every test_* function of the test_*.py files here; exit 1 if one fails."""
import importlib
import pathlib
import sys
import traceback

sys.path.insert(0, ".")
passed = failed = 0
for path in sorted(pathlib.Path(".").glob("test_*.py")):
    module = importlib.import_module(path.stem)
    for name, test in sorted(vars(module).items()):
        if not (name.startswith("test_") and callable(test)):
            continue
        try:
            test()
        except Exception as error:
            failed += 1
            frame = traceback.extract_tb(error.__traceback__)[-1]
            print(f"FAIL {name}: line {frame.lineno}: {frame.line} ({type(error).__name__})")
        else:
            passed += 1
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed or not passed else 0)
'''

_SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed$")


class PyfixData(AgentTaskData):
    """One buggy function and its test."""

    function: str
    buggy: str
    """The wrong return expression in ``calc.py``."""
    fixed: str
    """The expression that makes the tests pass."""
    num_tests: int = 1
    """Test functions the runner must report as passed."""


def source(name: str, expression: str) -> str:
    return f"def {name}(a, b):\n    return {expression}\n"


def _value(expression: str, a: int, b: int) -> int:
    return int(eval(expression, {"max": max, "min": min, "abs": abs}, {"a": a, "b": b}))


def tests_source(name: str, fixed: str, cases: tuple[tuple[int, int], ...]) -> str:
    asserts = "".join(f"    assert {name}({a}, {b}) == {_value(fixed, a, b)}\n" for a, b in cases)
    return f"from calc import {name}\n\n\ndef test_{name}():\n{asserts}"


def tool_call(name: str, **arguments: str) -> str:
    """A tool call as the model writes it (the hermes format)."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def oracle_replies(data: PyfixData) -> list[str]:
    """The replies of a correct episode: run the tests, read the code, fix it, check, finish."""
    return [
        tool_call("run_tests"),
        tool_call("read_file", path=MODULE),
        tool_call("edit_file", path=MODULE, old_string=data.buggy, new_string=data.fixed),
        tool_call("run_tests"),
        "Fixed: the tests pass.",
    ]


def make_task_data(
    name: str, fixed: str, buggy: str, cases: tuple[tuple[int, int], ...], case_id: int
) -> PyfixData:
    data = PyfixData(
        id=f"{name}-{case_id}",
        system_prompt=SYSTEM_PROMPT,
        prompt=f"The tests in {TEST_FILE} fail. Fix the function {name} in {MODULE}.",
        files={
            MODULE: source(name, buggy),
            TEST_FILE: tests_source(name, fixed, cases),
            RUNNER: RUNNER_SOURCE,
        },
        tools=list(TOOLS),  # type: ignore[arg-type]  # literal tool names
        test_command=TEST_COMMAND,
        function=name,
        buggy=buggy,
        fixed=fixed,
    )
    return data.model_copy(update={"reference_replies": oracle_replies(data)})


class PyfixConfig(vf.TasksetConfig):
    """Which tasks the taskset yields."""

    split: Literal["train", "eval"] = "train"
    """``train``: the first argument sets of every function; ``eval``: the held-out last one."""
    num_functions: int = Field(len(FUNCTIONS), ge=1, le=len(FUNCTIONS))
    """Use only the first this-many functions of ``FUNCTIONS``."""
    num_tasks: int | None = Field(None, ge=1)
    """Yield only the first this-many tasks of the split; ``None`` yields all."""


class PyfixTask(vf.Task[PyfixData, AgentState]):
    """Grades the episode's ``calc.py`` against the pristine tests in a fresh workspace."""

    @vf.reward(weight=1.0)
    async def solved(self, trace: vf.Trace) -> float:
        state = trace.state
        if not isinstance(state, AgentState) or state.workspace is None or state.sandbox is None:
            return 0.0
        sandbox = state.sandbox
        edited = read_files(state.workspace, [MODULE])
        workspace = await asyncio.to_thread(fresh_workspace, sandbox, self.data.files, edited)
        try:
            run = await sandbox.run_async(
                workspace, self.data.test_command or TEST_COMMAND, limits=sandbox.config.test_limits
            )
        finally:
            await asyncio.to_thread(workspace.close)
        lines = run.stdout.strip().splitlines()
        summary = _SUMMARY.match(lines[-1]) if lines else None
        if run.exit_code == 0 and summary is not None and int(summary.group(1)) == self.data.num_tests:
            return 1.0
        output = (run.stdout + run.stderr).strip()[-1000:] or f"the tests exited with {run.exit_code}"
        trace.info["feedback"] = {"text": output, "kind": "failing_test"}
        return 0.0

    @vf.metric
    async def edited(self, trace: vf.Trace) -> float:
        """Whether ``calc.py`` differs from the task's at the end of the episode."""
        state = trace.state
        if not isinstance(state, AgentState) or state.workspace is None:
            return 0.0
        return float(read_files(state.workspace, [MODULE]).get(MODULE) != self.data.files[MODULE])


class PyfixTaskset(vf.Taskset[PyfixTask, PyfixConfig]):
    """Every function x argument set of the configured split, one task each."""

    def load(self) -> list[PyfixTask]:
        config = self.config
        chosen = range(len(CASES) - 1) if config.split == "train" else [len(CASES) - 1]
        tasks = [
            PyfixTask(make_task_data(name, fixed, buggy, CASES[case], case), config.task)
            for case in chosen
            for name, fixed, buggy in FUNCTIONS[: config.num_functions]
        ]
        return tasks if config.num_tasks is None else tasks[: config.num_tasks]

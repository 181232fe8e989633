"""The grader: the reward of an agent's workspace, decided outside it.

Grading never runs anything in the agent's workspace and never trusts a file the agent wrote,
other than as source code to import. It

1. reads the agent's **source files** out of the workspace (``trees.collect_sources``: non-test
   ``.py`` files inside the project's packages, regular files only); tests, ``conftest.py``,
   pytest configuration and data files always come from the pristine project;
2. runs **pytest** on a fresh workspace holding the pristine tree with those source files, in
   its own sandboxed process, with the runner and its reporter plugin sent from outside (the
   runner is not a file anywhere the agent could have written). Exit status and output are
   ignored: a test counts as passed only if its setup, call and teardown each reported so, and a
   test with no report (the run exited, crashed or timed out) failed;
3. runs the **probe** on another fresh workspace holding *only* the package folders (no tests, so
   no expected value is in reach): the calls the targeted tests made with the original code,
   made again with the recorded plain-data arguments, each outcome written back as plain data;
4. compares the probe outcomes, here, with the outcomes the original code produced at
   generation time. Those never enter any sandbox, so no code of the agent can read or forge
   them; a value without a plain form (an object whose ``__eq__`` always answers true, a
   subclass of ``list``) cannot equal one.

Reward: 0 if any *other* test (one that passes with and without the feature) does not pass;
otherwise the share of targeted tests that pass **and** whose every probe matches (``binary``:
1 only if all of them do). The pytest verdict alone is never enough for a targeted test, since
the agent's code runs inside that pytest process and could rewrite its reports; the probe is
what it cannot fake. See the environment's README for each known hack and what stops it.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from feature_deletion import runs, trees
from feature_deletion.corpus import Project
from feature_deletion.tasks import Task
from prime_composer.config.sandbox import LimitsConfig
from prime_composer.sandbox import Sandbox, SandboxError

FLOAT_REL_TOL = 1e-9
FLOAT_ABS_TOL = 1e-12


@dataclass
class Grade:
    """The reward of one workspace and how it came about."""

    reward: float
    num_targeted: int
    targeted_passed: int
    """Targeted tests that passed in pytest and matched every probe."""
    pytest_passed: int
    """Targeted tests pytest reported as passed (whatever the probes said)."""
    num_others: int
    others_broken: int
    num_probes: int
    probes_matched: int
    pytest_ended: bool
    error: str | None = None
    """Why grading could not look at the code (too many files, the sandbox failed), if it could not."""
    pytest_s: float = 0.0
    probe_s: float = 0.0
    total_s: float = 0.0
    sandbox_s: float = 0.0
    """Time inside sandboxed runs (set-up included), part of ``total_s``."""
    broken: list[str] = field(default_factory=list)
    """Some of the other tests that broke (at most 10)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def same(a: Any, b: Any) -> bool:
    """Equality of two encoded values, floats within a relative 1e-9 (and NaN equal to NaN)."""
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return False
        if len(a) == 2 and a[0] == b[0] == "f" and isinstance(a[1], str) and isinstance(b[1], str):
            return _close(a[1], b[1])
        if len(a) == 3 and a[0] == b[0] == "c":
            return all(_close(x, y) for x, y in zip(a[1:], b[1:], strict=True))
        return all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _close(x: Any, y: Any) -> bool:
    try:
        fx, fy = float(x), float(y)
    except (TypeError, ValueError):
        return False
    if math.isnan(fx) or math.isnan(fy):
        return math.isnan(fx) and math.isnan(fy)
    return math.isclose(fx, fy, rel_tol=FLOAT_REL_TOL, abs_tol=FLOAT_ABS_TOL)


def usable(outcome: Any) -> bool:
    """Whether an outcome of the original code can serve as an expected value (plain data, the
    call could be set up)."""
    if not (isinstance(outcome, list) and len(outcome) == 2 and isinstance(outcome[0], list)):
        return False
    result, after = outcome
    return result[0] in ("v", "iter", "raise") and not any(a == ["np"] for a in after)


def mentions_class(value: Any, module: str, qualname: str) -> bool:
    """Whether an encoded value holds an instance of ``module.qualname`` (or a reference to it)."""
    if isinstance(value, list):
        if len(value) >= 2 and value[0] == "o" and value[1] == [module, qualname]:
            return True
        if len(value) == 3 and value[0] == "ref" and value[1:] == [module, qualname]:
            return True
        return any(mentions_class(v, module, qualname) for v in value)
    if isinstance(value, dict):
        return any(mentions_class(v, module, qualname) for v in value.values())
    return False


def grade(
    task: Task,
    project: Project,
    tree: Path,
    sandbox: Sandbox,
    workspace_dir: Path,
    *,
    test_limits: LimitsConfig,
    probe_limits: LimitsConfig,
    binary: bool = False,
) -> Grade:
    """Grade the agent's workspace folder ``workspace_dir`` (see the module docstring)."""
    start = time.monotonic()
    empty = Grade(0.0, len(task.targeted), 0, 0, len(task.others), 0, len(task.probes), 0, False)
    try:
        sources = trees.collect_sources(project.spec, workspace_dir)
    except (trees.SourceError, OSError) as e:
        empty.error = f"sources: {e}"
        empty.total_s = time.monotonic() - start
        return empty
    try:
        outcomes, pytest_s, ended = _run_tests(project, tree, sandbox, sources, test_limits)
        results, probe_s = _run_probes(task, project, tree, sandbox, sources, probe_limits)
    except SandboxError as e:
        empty.error = f"sandbox: {e}"
        empty.total_s = time.monotonic() - start
        return empty
    matched = [r is not None and same(r, p.expected) for r, p in zip(results, task.probes, strict=True)]
    broken = [t for t in task.others if outcomes.get(t) != "passed"]
    pytest_passed = [t for t in task.targeted if outcomes.get(t) == "passed"]
    passed = [t for t in pytest_passed if all(matched[i] for i in task.probes_of(t))]
    if broken:
        reward = 0.0
    elif binary:
        reward = float(len(passed) == len(task.targeted))
    else:
        reward = len(passed) / len(task.targeted)
    return Grade(
        reward=reward,
        num_targeted=len(task.targeted),
        targeted_passed=len(passed),
        pytest_passed=len(pytest_passed),
        num_others=len(task.others),
        others_broken=len(broken),
        num_probes=len(task.probes),
        probes_matched=sum(matched),
        pytest_ended=ended,
        pytest_s=pytest_s,
        probe_s=probe_s,
        total_s=time.monotonic() - start,
        sandbox_s=pytest_s + probe_s,
        broken=broken[:10],
    )


def _run_tests(
    project: Project, tree: Path, sandbox: Sandbox, sources: dict[str, bytes], limits: LimitsConfig
) -> tuple[dict[str, str], float, bool]:
    with tempfile.TemporaryDirectory(prefix="fd-grade-") as tmp:
        staged = Path(tmp) / "tree"
        trees.stage_test_tree(project.spec, tree, sources, staged)
        with sandbox.workspace(staged) as ws:
            result, _ = runs.run_pytest(sandbox, ws, project.spec, limits)
    return result.outcomes, result.run.duration_s, result.ended


def _run_probes(
    task: Task,
    project: Project,
    tree: Path,
    sandbox: Sandbox,
    sources: dict[str, bytes],
    limits: LimitsConfig,
) -> tuple[list[Any | None], float]:
    results, run = probe(project, tree, sandbox, sources, [p.call for p in task.probes], limits)
    return results, run.duration_s


def probe(
    project: Project,
    tree: Path,
    sandbox: Sandbox,
    sources: dict[str, bytes],
    calls: list[dict[str, Any]],
    limits: LimitsConfig,
) -> tuple[list[Any | None], runs.RunResult]:
    """Make ``calls`` against ``sources`` in a fresh workspace holding only the package folders."""
    with tempfile.TemporaryDirectory(prefix="fd-probe-") as tmp:
        staged = Path(tmp) / "tree"
        trees.stage_probe_tree(project.spec, tree, sources, staged)
        with sandbox.workspace(staged) as ws:
            return runs.run_probe(sandbox, ws, project.spec, calls, limits)

"""Sandboxed runs of a project: the test Python, the environment's sandbox, pytest and probe jobs.

Every run is ``python -s -B -c <sandboxed.py>`` with a JSON job on stdin (see ``sandboxed.py``):
the runner never exists inside the workspace, so the agent cannot edit it, and its results are
read back from the run's private temporary folder as data (regular files only, size-capped, bad
lines skipped). A run that crashes, exits early or times out simply leaves fewer lines.

The Python inside is a venv of its own (``test_python``): the interpreter of this process with
only pytest (this environment's pinned version) installed and its bytecode compiled, so sandboxed
code sees no other packages and starts in ~0.3 s.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from feature_deletion.spec import ProjectSpec, Store
from prime_composer.config.sandbox import LimitsConfig, SandboxConfig
from prime_composer.sandbox import RunResult, Sandbox, Workspace

SANDBOXED_SOURCE = Path(__file__).with_name("sandboxed.py").read_text()
PYTHON = ["python", "-s", "-B", "-c", SANDBOXED_SOURCE]
"""The command of every job (``-s``: no user site; ``-B``: no bytecode written)."""

SANDBOX_ENV = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONHASHSEED": "0"}
"""Added to the sandbox environment: no third-party pytest plugins, stable hashing (set orders)."""

MAX_RESULT_BYTES = 64 * 2**20
"""Largest results file read back; a bigger one counts as unreadable."""


def test_python(store: Store) -> Path:
    """The venv sandboxed tests run with (created on first use, then reused)."""
    version = importlib.metadata.version("pytest")
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-pytest{version}"
    env = store.python(tag)
    done = env / ".complete"
    if done.exists():
        return env
    uv = shutil.which("uv")
    if uv is None:
        raise RuntimeError(
            "feature-deletion: `uv` is not on PATH; it is needed once to create the test Python"
        )
    env.parent.mkdir(parents=True, exist_ok=True)
    with open(env.parent / f".{tag}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return env
        shutil.rmtree(env, ignore_errors=True)
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([uv, "venv", "-q", "--python", base, str(env)], check=True)
        install = [uv, "pip", "install", "-q", "--python", str(env / "bin" / "python"), "--compile-bytecode"]
        offline = subprocess.run([*install, "--offline", f"pytest=={version}"], capture_output=True)
        if offline.returncode != 0:  # not in uv's cache: fetch it from the index
            subprocess.run([*install, f"pytest=={version}"], check=True)
        done.touch()
    return env


def sandbox_config(base: SandboxConfig, python_env: Path, hidden: Sequence[Path] = ()) -> SandboxConfig:
    """``base`` with the test Python, the extra hidden folders and the test environment variables."""
    hidden_paths = list(dict.fromkeys(Path(p).resolve() for p in [*base.hidden_paths, *hidden]))
    return base.model_copy(
        update={
            "python_env": python_env,
            "hidden_paths": hidden_paths,
            "extra_env": {**base.extra_env, **SANDBOX_ENV},
        }
    )


def for_project(limits: LimitsConfig, spec: ProjectSpec) -> LimitsConfig:
    """``limits`` with the project's own test time limit, when its manifest entry sets one."""
    if spec.test_timeout_s is None:
        return limits
    return limits.model_copy(update={"timeout_s": spec.test_timeout_s, "cpu_s": int(spec.test_timeout_s) + 1})


@dataclass
class PytestResult:
    """How each test of one pytest run ended: ``passed``, ``failed``, ``error``, ``skipped``,
    ``xfailed`` or ``xpassed``; tests with no line at all are simply absent."""

    outcomes: dict[str, str]
    ended: bool
    """The runner wrote its final line (pytest returned)."""
    exit_code: int | None
    collect_errors: list[str]
    run: RunResult

    def passed(self) -> set[str]:
        return {test for test, outcome in self.outcomes.items() if outcome == "passed"}


@dataclass
class RecordedTest:
    """What the recorder saw during one test (original code)."""

    covered: set[int]
    calls: list[dict[str, Any]]
    num_unplain: int


@dataclass
class Recording:
    """The recorder's output: the function table, per-test records, import-time functions."""

    functions: dict[int, dict[str, Any]] = field(default_factory=dict)
    tests: dict[str, RecordedTest] = field(default_factory=dict)
    outside: set[int] = field(default_factory=set)


def pytest_args(spec: ProjectSpec, root: Path, selection: Sequence[str] | None = None) -> list[str]:
    """pytest's arguments for a run in ``root``: the project's config minus its ``addopts``,
    no cache, no tracebacks, then ``selection`` (test ids) or the project's test paths."""
    return [
        "-q",
        "--tb=no",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        f"--rootdir={root}",
        *spec.pytest_args,
        *(spec.tests if selection is None else selection),
    ]


def run_pytest(
    sandbox: Sandbox,
    ws: Workspace,
    spec: ProjectSpec,
    limits: LimitsConfig,
    *,
    selection: Sequence[str] | None = None,
    record: dict[str, Any] | None = None,
) -> tuple[PytestResult, Recording | None]:
    """Run the project's tests (or ``selection``) in ``ws``; with ``record``, profile them too."""
    report = ws.tmp / "report.jsonl"
    job: dict[str, Any] = {
        "mode": "pytest",
        "src": str(ws.path / spec.source_root),
        "packages": spec.import_names,
        "package_paths": spec.package_paths,
        "test_paths": spec.tests,
        "report": str(report),
        "args": pytest_args(spec, ws.path, selection),
    }
    record_file = ws.tmp / "record.jsonl"
    if record is not None:
        job["record"] = {**record, "out": str(record_file)}
    run = sandbox.run(ws, PYTHON, limits=limits, stdin=json.dumps(job).encode())
    result = parse_report(read_lines(report), run)
    recording = parse_recording(read_lines(record_file)) if record is not None else None
    return result, recording


def run_probe(
    sandbox: Sandbox, ws: Workspace, spec: ProjectSpec, calls: Sequence[dict[str, Any]], limits: LimitsConfig
) -> tuple[list[Any | None], RunResult]:
    """Make ``calls`` against the project in ``ws``; one outcome per call (``None``: none came back)."""
    out = ws.tmp / "probe.jsonl"
    job = {
        "mode": "probe",
        "src": str(ws.path / spec.source_root),
        "packages": spec.import_names,
        "calls": list(calls),
        "out": str(out),
    }
    run = sandbox.run(ws, PYTHON, limits=limits, stdin=json.dumps(job).encode())
    outcomes: list[Any | None] = [None] * len(calls)
    for line in read_lines(out):
        index = line.get("i")
        if isinstance(index, int) and 0 <= index < len(calls) and outcomes[index] is None:
            outcomes[index] = line.get("r")
    return outcomes, run


def read_lines(path: Path, max_bytes: int = MAX_RESULT_BYTES) -> Iterator[dict[str, Any]]:
    """The JSON-object lines of a file written by sandboxed code; nothing if it is not a regular
    file or is larger than ``max_bytes``; lines that do not parse are skipped."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > max_bytes:
            return
        data = f.read(max_bytes + 1)
    for raw in data.splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if isinstance(line, dict):
            yield line


def parse_report(lines: Iterator[dict[str, Any]], run: RunResult) -> PytestResult:
    phases: dict[str, dict[str, tuple[str, bool]]] = {}
    ended, exit_code, collect_errors = False, None, []
    for line in lines:
        if "end" in line:
            ended, exit_code = True, line["end"] if isinstance(line["end"], int) else None
        elif "collect_error" in line:
            collect_errors.append(str(line["collect_error"]))
        elif isinstance(line.get("test"), str) and line.get("when") in ("setup", "call", "teardown"):
            phases.setdefault(line["test"], {})[line["when"]] = (
                str(line.get("outcome")),
                bool(line.get("xfail")),
            )
    return PytestResult(
        {test: _outcome(p) for test, p in phases.items()}, ended, exit_code, collect_errors, run
    )


def why_unfinished(result: PytestResult, limits: LimitsConfig) -> str:
    """Why a pytest run did not run to its end, in one line: the limit it hit (and how to raise
    it), the signal or exit status, collection errors, and the tail of what it printed."""
    run = result.run
    parts: list[str] = []
    if run.timed_out:
        parts.append(
            f"timed out after {run.duration_s:.1f} s (the limit is {limits.timeout_s:g} s: raise it with "
            "--test-timeout-s, or test_timeout_s in the project's manifest entry)"
        )
    elif run.killed_by:
        parts.append(f"killed by the {run.killed_by} limit")
    elif run.signal:
        parts.append(f"killed by {run.signal}")
    elif not result.ended:
        parts.append(f"exited with status {run.exit_code} before pytest returned")
    hit = [h for h in run.limits_hit if h != run.killed_by and not (h == "timeout" and run.timed_out)]
    if hit:
        parts.append(f"limits hit: {', '.join(hit)}")
    if result.collect_errors:
        parts.append(
            f"{len(result.collect_errors)} collection errors, e.g. {result.collect_errors[0][-300:]!r}"
        )
    tail = (run.stderr.strip() or run.stdout.strip())[-300:]
    parts.append(f"output: {' '.join(tail.split())!r}" if tail else "no output")
    return "; ".join(parts)


def _outcome(phases: dict[str, tuple[str, bool]]) -> str:
    setup = phases.get("setup")
    if setup is None:
        return "error"
    if setup[0] == "failed":
        return "error"
    if setup[0] == "skipped":
        return "xfailed" if setup[1] else "skipped"
    call = phases.get("call")
    teardown = phases.get("teardown")
    if call is None or teardown is None:
        return "error"  # the run ended inside the test
    if call[0] == "skipped":
        outcome = "xfailed" if call[1] else "skipped"
    elif call[0] == "passed":
        outcome = "xpassed" if call[1] else "passed"
    else:
        outcome = "failed"
    if teardown[0] == "failed" and outcome == "passed":
        return "error"
    return outcome


def parse_recording(lines: Iterator[dict[str, Any]]) -> Recording:
    recording = Recording()
    for line in lines:
        if "fn" in line and "file" in line:
            recording.functions[int(line["fn"])] = line
        elif "outside" in line:
            recording.outside = set(line["outside"])
        elif "covered" in line:
            recording.tests[str(line["test"])] = RecordedTest(
                set(line["covered"]), list(line["calls"]), int(line.get("num_unplain", 0))
            )
    return recording

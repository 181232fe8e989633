"""A validated task (``Task``) and the taskset file that holds them (``tasks.jsonl``).

A task names the deleted feature, the files of the agent's workspace that differ from the
project's pristine tree (the stubbed file; for the canary also a redacted test), the tests that
score it and the probes with their expected outcomes. Everything the grader needs is in it, so
the file is private: it lives in the store, which sandboxed code cannot see, and only the prompt
and a few labels travel on traces (``taskset.FeatureDeletionData``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from feature_deletion.spec import CorpusName
from prime_composer.io import atomic_write_text

Kind = Literal["function", "method", "class"]


class Probe(BaseModel):
    """One recorded call into the project, made again by the grader against the agent's code."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    test: str
    """The targeted test whose code made the call."""
    call: dict[str, Any]
    """``{"target": [module, qualname, accessor], "args": [...], "kwargs": {...}}`` in plain data."""
    expected: Any
    """The outcome with the original code: ``[result, args_after]`` (see ``sandboxed.probe_call``)."""


class Task(BaseModel):
    """One validated feature-deletion task."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    project: str
    """Slug (``name-version``) of the built project."""
    corpus: CorpusName
    kind: Kind
    file: str
    """File holding the feature, relative to the project root."""
    qualname: str
    symbols: list[str]
    """Qualified names whose bodies were removed (one, or every method of a class)."""
    workspace_files: dict[str, str]
    """Files of the agent's workspace that differ from the pristine tree (path -> text)."""
    removed: list[str]
    """The removed bodies: what an oracle puts back."""
    leak_needles: list[str]
    """Strings that must appear nowhere the agent can read: the removed lines found nowhere else
    in the project, and for the canary its secret."""
    targeted: list[str] = Field(min_length=1)
    """Tests that pass with the original code, fail without the feature and have probes."""
    others: list[str]
    """Tests that pass with and without the feature: they must still pass."""
    unscored: list[str]
    """Tests that fail without the feature but have no probe; they do not count either way."""
    probes: list[Probe] = Field(min_length=1)
    prompt: str

    def probes_of(self, test: str) -> list[int]:
        return [i for i, probe in enumerate(self.probes) if probe.test == test]


def prompt_text(kind: Kind, qualname: str, file: str, project: str, targeted: list[str]) -> str:
    """The user message of a task: what was removed, where, and which tests exercise it."""
    what = {"function": "function", "method": "method", "class": "class (every method of it)"}[kind]
    shown = targeted[:8]
    more = f"\n  ... and {len(targeted) - len(shown)} more" if len(targeted) > len(shown) else ""
    tests = "\n".join(f"  {t}" for t in shown) + more
    return (
        f"The implementation of the {what} `{qualname}` in `{file}` of the Python project `{project}` "
        "has been removed: its signature and docstring are still there, but its body now raises "
        "NotImplementedError. Write it again so that the project's tests pass.\n\n"
        f"These tests exercise it:\n{tests}\n\n"
        "Use the tools to read the code and to run the tests (run_tests runs the whole suite). "
        "Change only the project's source files: grading runs its own copy of the tests."
    )


def write_tasks(path: Path, tasks: list[Task]) -> None:
    atomic_write_text(path, "".join(task.model_dump_json() + "\n" for task in tasks))


def read_tasks(path: Path) -> list[Task]:
    """The tasks of a ``tasks.jsonl``; a malformed line is an error naming the file and line."""
    tasks = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            tasks.append(Task.model_validate_json(line))
        except ValueError as e:
            raise ValueError(f"{path}:{number}: not a task: {e}") from e
    return tasks


def write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True) + "\n")

"""Episodes: one attempt at a task, on a fresh workspace, through the coding tools; then its grade.

``FeatureDeletion`` holds what every episode of a taskset shares (the sandbox, the built
projects, the tasks); ``FeatureDeletion.episode(task_id)`` opens an ``Episode``:

    with env.episode(task.id) as episode:
        request["tools"] = episode.tools.definitions()     # OpenAI tools format
        result = episode.tools.call(name, arguments_json)  # what a model's tool call does
        grade = episode.grade()                            # after the last turn

The agent loop is not here: a model (through the harness) or a scripted agent (``agents.py``)
drives ``episode.tools``, and both are graded the same way. The workspace holds the project's
cleaned tree with the task's files (the stub) written in; its test command runs the suite the
way grading does, with the pristine configuration (no ``addopts``).
"""

from __future__ import annotations

import shlex
import threading
from collections.abc import Sequence
from pathlib import Path

from feature_deletion import grader, runs, visibility
from feature_deletion.corpus import Project, fingerprint, load_project, stored_hidden
from feature_deletion.environment import Limits, open_sandbox
from feature_deletion.spec import Store
from feature_deletion.tasks import Task, read_tasks
from prime_composer.config.sandbox import ToolsConfig
from prime_composer.sandbox import Sandbox, Toolset, Workspace

TOOLS = ToolsConfig(
    enabled=["list_files", "read_file", "search", "write_file", "edit_file", "run", "run_tests"]
)


def test_command(project: Project) -> str:
    """The agent's ``run_tests``: the suite as grading runs it (short tracebacks, no cache)."""
    spec = project.spec
    args = ["python", "-m", "pytest", "-q", "--tb=short", "-p", "no:cacheprovider", "-o", "addopts="]
    args += [*spec.pytest_args, *spec.tests]
    return f"PYTHONPATH={shlex.quote(spec.source_root)} " + shlex.join(args)


class Episode:
    """One attempt at one task: a workspace, the tools on it, and ``grade``."""

    def __init__(self, env: FeatureDeletion, task: Task) -> None:
        self.env = env
        self.task = task
        self.project = env.projects[task.project]
        self.workspace: Workspace = env.sandbox.workspace(env.tree(task))
        try:
            for rel, text in task.workspace_files.items():
                (self.workspace.path / rel).write_text(text)
            self.tools = Toolset(
                env.sandbox, self.workspace, env.tools, test_command=test_command(self.project)
            )
        except BaseException:
            self.workspace.close()
            raise
        self.result: grader.Grade | None = None

    def grade(self, *, binary: bool | None = None) -> grader.Grade:
        """Grade the workspace as it is now (see ``grader``); the result is kept in ``result``."""
        env = self.env
        self.result = grader.grade(
            self.task,
            self.project,
            env.tree(self.task),
            env.sandbox,
            self.workspace.path,
            test_limits=runs.for_project(env.limits.test(), self.project.spec),
            probe_limits=env.limits.probe(),
            binary=env.binary if binary is None else binary,
        )
        return self.result

    def close(self) -> None:
        self.workspace.close()

    def __enter__(self) -> Episode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FeatureDeletion:
    """The tasks of one taskset in a store, the sandbox they run in, and their projects.

    The sandbox hides ``hidden_paths`` and every folder the projects were built with hidden
    (``Project.hidden_paths``), whatever the caller names. Before any episode starts, the
    visibility scan runs in that sandbox (``check_visibility``, ~10 s on an idle machine): a
    readable copy of one of the projects, in any form, refuses the whole taskset with a
    ``ValueError`` naming where it is."""

    def __init__(
        self,
        store: Store,
        taskset: str,
        *,
        hidden_paths: Sequence[Path] = (),
        limits: Limits | None = None,
        binary: bool = False,
        sandbox: Sandbox | None = None,
        tools: ToolsConfig = TOOLS,
        check_visibility: bool = True,
    ) -> None:
        self.store = store
        path = store.taskset(taskset) / "tasks.jsonl"
        if not path.is_file():
            raise ValueError(
                f"feature-deletion: no taskset {taskset!r} in {store.root} ({path} is missing); run "
                "generate_tasks.py (see the environment's README)"
            )
        self.tasks = {task.id: task for task in read_tasks(path)}
        self.projects = {
            slug: load_project(store, slug) for slug in sorted({t.project for t in self.tasks.values()})
        }
        self.limits = limits or Limits()
        self.binary = binary
        self.tools = tools
        self._own_sandbox = sandbox is None
        hidden = [*stored_hidden(self.projects.values()), *hidden_paths]
        self.sandbox = sandbox or open_sandbox(store, hidden)
        self._lock = threading.Lock()
        try:
            self._check_hidden(hidden)
            if check_visibility:
                self.check_visibility()
        except BaseException:
            self.close()
            raise

    def _check_hidden(self, hidden: Sequence[Path]) -> None:
        """A sandbox given by the caller must hide what the projects were built with hidden."""
        covered = [Path(p).resolve() for p in self.sandbox.config.hidden_paths]
        for path in hidden:
            real = Path(path).resolve()
            if real.is_dir() and not any(real == c or c in real.parents for c in covered):
                raise ValueError(
                    f"feature-deletion: the sandbox does not hide {str(path)!r}, which the taskset's "
                    "projects were built with hidden (or hidden_paths names); add it to its hidden_paths"
                )

    def check_visibility(self) -> None:
        """Refuse (``ValueError``) when sandboxed code can read a copy of one of the projects."""
        prints = [fingerprint(p.spec, p.tree(self.store)) for p in self.projects.values()]
        try:
            found = visibility.scan(self.sandbox, prints, self.limits.scan())
        except visibility.VisibilityError as e:
            raise ValueError(f"feature-deletion: cannot start the taskset's episodes: {e}") from e
        for slug, paths in found.items():
            if paths:
                raise ValueError(
                    f"feature-deletion: sandboxed code can read a copy of {slug} at {paths[:3]} "
                    f"({len(paths)} in all); hide those folders (the taskset's hidden_paths, or "
                    "--hide when building the corpus, which stores them with the project)"
                )

    def tree(self, task: Task) -> Path:
        return self.projects[task.project].tree(self.store)

    def episode(self, task_id: str) -> Episode:
        task = self.tasks.get(task_id)
        if task is None:
            raise KeyError(f"feature-deletion: no task {task_id!r} in this taskset")
        return Episode(self, task)

    def close(self) -> None:
        if self._own_sandbox:
            self.sandbox.close()

    def __enter__(self) -> FeatureDeletion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The verifiers v1 side: a taskset of feature-deletion tasks whose reward is the grader's.

``FeatureDeletionTaskset`` loads a generated taskset from the store (``tasks.jsonl``) and yields
one ``FeatureDeletionTask`` per task. The task's data carries only the prompt and labels (it
rides on traces); the grading record stays in the store.

The task data is an ``AgentTaskData``, so the orchestrator plays its episodes with the agent
harness (``prime_composer.orchestrator.agent_harness``, multi-turn, tool-using), with one
difference from other agentic tasks: the workspace is not made by the harness from ``files``
(its sandbox hides less than this environment needs: the store, every other ``site-packages``,
the corpus sources) but by the task:

- ``setup(trace, runtime)`` opens an ``Episode`` (fresh workspace in the environment's own
  sandbox, coding tools) and puts it on ``trace.state`` (``FeatureDeletionState``), with its
  workspace and ``Toolset``; the harness runs the model's tool calls with that toolset;
- the reward ``restored`` grades that workspace when the rollout is scored, writes the grade to
  ``trace.info["feature_deletion_grade"]`` (and a failing test as ``feedback`` for SDPO hints),
  and closes the episode (the harness's cleanup closing it again is a no-op). A rollout that
  never opened an episode scores 0 and says why.

``open_episode()`` gives the same episode without verifiers, for scripted agents and tests.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import threading
from pathlib import Path
from typing import Literal

import verifiers.v1 as vf
from pydantic import Field

from feature_deletion import corpus, generate
from feature_deletion.cli import manifest
from feature_deletion.environment import Limits, open_sandbox
from feature_deletion.episode import Episode, FeatureDeletion, test_command
from feature_deletion.grader import Grade
from feature_deletion.spec import Store, load_manifest
from feature_deletion.tasks import write_tasks
from prime_composer.orchestrator.agent_task import AgentState, AgentTaskData

GRADE_KEY = "feature_deletion_grade"

SYSTEM_PROMPT = (
    "You are working in a Python project's folder through tools: list_files, read_file, search, "
    "write_file, edit_file, run (a bash command, no network) and run_tests. Read the code around "
    "the missing feature, write it, and run the tests until they pass."
)


class FeatureDeletionConfig(vf.TasksetConfig):
    """Which generated tasks to serve and how they are graded."""

    store: str | None = None
    """Store folder (default ``~/.cache/prime-composer/feature-deletion``)."""
    taskset: str | None = None
    """Name of the generated taskset in the store; default: the corpus name."""
    corpus: Literal["ci", "pypi"] = "ci"
    """Corpus the taskset was generated from (``build`` builds it when missing)."""
    build: bool = False
    """Build the corpus and generate the taskset if the store does not hold it yet (only for the
    ``ci`` corpus, which needs no network; ~1 minute)."""
    build_tasks_per_project: int | None = Field(default=None, ge=1)
    """With ``build``: stop generating a project's tasks once this many are accepted (default: all
    that validate, up to 40), for a quick run that needs only a few; give such a taskset its own
    ``taskset`` name, since a built taskset is reused as it is."""
    split: Literal["train", "eval"] = "train"
    eval_fraction: float = Field(default=0.1, ge=0, lt=1)
    """Share of the tasks held out for ``eval`` (seeded by ``split_seed``)."""
    split_seed: int = 0
    num_tasks: int | None = Field(default=None, ge=1)
    """Serve only the first this-many tasks of the split."""
    binary: bool = False
    """Reward 1 only when every targeted test passes (default: the share that pass)."""
    hidden_paths: list[str] = Field(default_factory=list)
    """More folders sandboxed code must not see (e.g. other checkouts of this repository)."""
    test_timeout_s: float = Field(default=120.0, gt=0)
    probe_timeout_s: float = Field(default=30.0, gt=0)


class FeatureDeletionData(AgentTaskData):
    """What travels on a trace: the prompt, labels, tools and test command, never the expected
    values; ``files`` stays empty (``setup`` makes the workspace, see the module docstring)."""

    project: str
    file: str
    qualname: str
    kind: str
    canary: bool = False


class FeatureDeletionState(AgentState):
    """The agent harness's state plus the episode ``setup`` opened (never serialized)."""

    episode: Episode | None = None


_runtimes: dict[str, FeatureDeletion] = {}
_lock = threading.Lock()


def runtime(config: FeatureDeletionConfig) -> FeatureDeletion:
    """The process-wide ``FeatureDeletion`` (sandbox, projects, tasks) of a config."""
    key = _runtime_key(config)
    with _lock:
        env = _runtimes.get(key)
        if env is None:
            store = Store(Path(config.store) if config.store else None)
            name = config.taskset or config.corpus
            hidden = [Path(p) for p in config.hidden_paths]
            limits = Limits(test_timeout_s=config.test_timeout_s, probe_timeout_s=config.probe_timeout_s)
            if config.build and not (store.taskset(name) / "tasks.jsonl").is_file():
                generation = generate.GenerationConfig()
                if config.build_tasks_per_project is not None:
                    generation = generation.model_copy(
                        update={"max_tasks_per_project": config.build_tasks_per_project}
                    )
                build_taskset(store, config.corpus, name, hidden, limits, generation)
            env = _runtimes[key] = FeatureDeletion(
                store, name, hidden_paths=hidden, limits=limits, binary=config.binary
            )
        return env


def _runtime_key(config: FeatureDeletionConfig) -> str:
    fields = ("store", "taskset", "corpus", "binary", "hidden_paths", "test_timeout_s", "probe_timeout_s")
    return json.dumps([getattr(config, f) for f in fields])


def build_taskset(
    store: Store,
    corpus_name: str,
    name: str,
    hidden: list[Path],
    limits: Limits,
    generation: generate.GenerationConfig | None = None,
) -> None:
    """Build the CI corpus and generate its taskset into the store (no network needed)."""
    if corpus_name != "ci":
        raise ValueError(
            "feature-deletion: build = true only builds the ci corpus; build the pypi corpus with "
            "build_corpus.py and generate_tasks.py (see the environment's README)"
        )
    store.ensure()
    with open_sandbox(store, hidden) as sandbox:
        projects = [
            corpus.build_project(spec, "ci", store, sandbox, limits=limits.test())
            for spec in load_manifest(manifest("ci"))
        ]
        tasks, _ = generate.generate(
            projects, store, sandbox, generation or generate.GenerationConfig(), limits.test(), limits.probe()
        )
    out = store.taskset(name)
    out.mkdir(parents=True, exist_ok=True)
    write_tasks(out / "tasks.jsonl", tasks)


def split_ids(ids: list[str], config: FeatureDeletionConfig) -> list[str]:
    """The task ids of ``config.split``: a seeded shuffle; the first ``eval_fraction`` are eval."""
    shuffled = sorted(ids)
    random.Random(config.split_seed).shuffle(shuffled)
    num_eval = math.ceil(config.eval_fraction * len(shuffled)) if config.eval_fraction else 0
    chosen = shuffled[:num_eval] if config.split == "eval" else shuffled[num_eval:]
    return chosen if config.num_tasks is None else chosen[: config.num_tasks]


def episode_for(trace: vf.Trace) -> Episode | None:
    """The episode ``setup`` opened for this rollout, if any."""
    state = trace.state
    return state.episode if isinstance(state, FeatureDeletionState) else None


class FeatureDeletionTask(vf.Task[FeatureDeletionData, FeatureDeletionState]):
    """One task; scored by the grader on the rollout's workspace."""

    runtime_key: str = ""

    def open_episode(self) -> Episode:
        env = _runtimes[self.runtime_key]
        return env.episode(str(self.data.id))

    async def setup(self, trace: vf.Trace, runtime: vf.Runtime) -> None:
        state = trace.state
        if not isinstance(state, FeatureDeletionState):
            raise TypeError(
                f"feature-deletion: trace state is {type(state).__name__}, not FeatureDeletionState"
            )
        episode = await asyncio.to_thread(self.open_episode)
        state.episode, state.sandbox, state.workspace, state.tools = (
            episode,
            episode.env.sandbox,
            episode.workspace,
            episode.tools,
        )

    @vf.reward(weight=1.0)
    async def restored(self, trace: vf.Trace) -> float:
        state = trace.state
        episode = state.episode if isinstance(state, FeatureDeletionState) else None
        if isinstance(state, FeatureDeletionState):
            state.episode = None
        if episode is None:
            trace.info[GRADE_KEY] = {"error": "no workspace: the harness never opened this task's episode"}
            return 0.0
        try:
            grade = await asyncio.to_thread(episode.grade)
        finally:
            await asyncio.to_thread(episode.close)
        trace.info[GRADE_KEY] = grade.to_dict()
        if grade.reward < 1.0:
            trace.info["feedback"] = _feedback(grade)
        return grade.reward

    @vf.metric
    async def others_broken(self, trace: vf.Trace) -> float:
        """Whether the rollout broke tests that passed without the feature (reward 0 then)."""
        grade = trace.info.get(GRADE_KEY) or {}
        return float(bool(grade.get("others_broken")))


def _feedback(grade: Grade) -> dict[str, str]:
    if grade.error:
        return {"text": f"Grading could not run: {grade.error}", "kind": "tool_error"}
    if grade.others_broken:
        shown = ", ".join(grade.broken[:3])
        return {
            "text": f"{grade.others_broken} tests that used to pass now fail (e.g. {shown}).",
            "kind": "failing_test",
        }
    return {
        "text": f"{grade.num_targeted - grade.targeted_passed} of the {grade.num_targeted} tests of the "
        "feature still fail.",
        "kind": "failing_test",
    }


class FeatureDeletionTaskset(vf.Taskset[FeatureDeletionTask, FeatureDeletionConfig]):
    """The tasks of a generated taskset, one split of it."""

    def load(self) -> list[FeatureDeletionTask]:
        env = runtime(self.config)
        key = _runtime_key(self.config)
        tasks = []
        for task_id in split_ids(list(env.tasks), self.config):
            record = env.tasks[task_id]
            task = FeatureDeletionTask(
                FeatureDeletionData(
                    id=record.id,
                    name=record.id,
                    prompt=record.prompt,
                    system_prompt=SYSTEM_PROMPT,
                    project=record.project,
                    file=record.file,
                    qualname=record.qualname,
                    kind=record.kind,
                    canary=record.corpus == "canary",
                    tools=list(env.tools.enabled),
                    test_command=test_command(env.projects[record.project]),
                ),
                self.config.task,
            )
            task.runtime_key = key
            tasks.append(task)
        return tasks

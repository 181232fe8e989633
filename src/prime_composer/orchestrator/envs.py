"""Load verifiers v1 environments by id, offline, for the rollout stage.

An ``[[orchestrator.env]]`` id names a taskset package. It is found, in this order, as

1. a folder ``<env_dir>/<id>/`` holding the package ``<module>/`` (the layout ``vf-init``
   scaffolds: ``environments/arith/{pyproject.toml, arith/__init__.py}``); the
   folder is put at the front of ``sys.path``, so nothing needs installing;
2. an installed package (``my-env`` imports ``my_env``), e.g. one added to the project's
   dependencies or installed with ``uv pip install -e``.

Every agent seat of the environment is pinned to what runs offline, in the subprocess runtime:
the in-process chat harness (``prime_composer.orchestrator.harness``: one chat call per episode)
or, when the taskset's tasks are ``AgentTaskData`` (they need tools), the agent harness
(``agent_harness.py``: multi-turn, token-in/token-out, tools in the sandbox) with the entry's
``agent`` settings. Nothing is pushed to a hub and nothing is installed at run time.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import verifiers.v1 as vf
from pydantic import ValidationError
from verifiers.v1.utils.loaders import env_config_type, taskset_class, taskset_config_type

from prime_composer.config.env import AgentLoopConfig, EnvConfig, RolloutConfig
from prime_composer.orchestrator import agent_harness
from prime_composer.orchestrator import harness as chat_harness
from prime_composer.orchestrator.agent_task import AgentTaskData, is_agent_taskset
from prime_composer.orchestrator.env_ids import DEFAULT_ENV_DIRS, local_environments, module_name
from prime_composer.orchestrator.task_prompt import task_messages

Split = Literal["train", "eval"]


def list_environments(env_dirs: Sequence[Path] = DEFAULT_ENV_DIRS) -> list[str]:
    """Ids that resolve without installing anything: local folders and verifiers' built-in tasksets
    (most built-ins need containers or network, so they may still fail to run offline)."""
    from verifiers.v1 import tasksets

    builtin = [m.name for m in pkgutil.iter_modules(tasksets.__path__)]
    return sorted(local_environments(env_dirs)) + [f"{name} (verifiers built-in)" for name in builtin]


def prepare_imports(env_dirs: Sequence[Path] = DEFAULT_ENV_DIRS) -> None:
    """Make local environments and the chat harness importable under the names verifiers uses."""
    # verifiers imports a harness by a plain module name (a dotted id breaks its lookup).
    sys.modules.setdefault(chat_harness.HARNESS_MODULE, chat_harness)
    sys.modules.setdefault(agent_harness.AGENT_HARNESS_MODULE, agent_harness)
    for folder in local_environments(env_dirs).values():
        path = str(folder)
        if path not in sys.path:
            sys.path.insert(0, path)


@dataclass
class LoadedEnv:
    """A loaded environment and the config entry it came from."""

    index: int
    """Position of the entry in ``orchestrator.env``."""
    config: EnvConfig
    env: vf.Env
    eval_taskset: vf.Taskset | None
    """The held-out split (``eval_args`` applied), or ``None`` when the entry has no eval."""
    agent: AgentLoopConfig | None = None
    """The agent loop's settings when the environment's tasks use tools; None for chat episodes."""

    @property
    def label(self) -> str:
        return self.config.label

    def tasks(self, split: Split = "train") -> list[vf.Task]:
        """The tasks of a split, in the taskset's order (``idx`` set to the position)."""
        if split == "train":
            return list(self.env.taskset)
        if self.eval_taskset is None:
            raise ValueError(
                f"orchestrator.env[{self.index}] (id={self.config.id!r}) has no eval split; "
                "set eval_args (e.g. {split = 'eval'}) on it"
            )
        taskset = self.eval_taskset
        if self.config.num_eval_examples is not None:
            taskset = taskset.take(self.config.num_eval_examples)
        return list(taskset)


def sft_records(loaded: LoadedEnv, split: Split = "train") -> list[dict[str, Any]]:
    """One SFT warm-up record (``{"messages": [...]}``, plus ``"tools"`` when the agent loop
    renders tool definitions) per task of a split: the task's prompt and its reference.

    Chat environments: the prompt messages and the ``answer`` as the assistant turn (``sft_pairs``).
    Agent environments: the task's ``reference_replies`` played against the real tools in a fresh
    workspace with the agent loop's own message building (``sft_play.play_references``), so SFT
    sees the tool results RL will see.
    """
    if loaded.agent is None:
        return [
            {"messages": [*messages, {"role": "assistant", "content": answer}]}
            for messages, answer in sft_pairs(loaded, split)
        ]
    from prime_composer.orchestrator.sft_play import play_references

    data = [task.data for task in loaded.tasks(split)]
    missing = [d.id or d.idx for d in data if not (isinstance(d, AgentTaskData) and d.reference_replies)]
    if missing:
        raise ValueError(
            f"orchestrator.env[{loaded.index}] (id={loaded.config.id!r}): tasks {missing[:5]} have no "
            "reference_replies, so they cannot provide SFT conversations; add them to the task data"
        )
    return play_references([d for d in data if isinstance(d, AgentTaskData)], loaded.agent)


def sft_pairs(loaded: LoadedEnv, split: Split = "train") -> list[tuple[list[dict[str, Any]], str]]:
    """(prompt messages, reference answer) for every task of a split, for SFT warm-up data.

    Needs a task data field named ``answer`` (the verifiers convention for a reference).
    """
    pairs = []
    for task in loaded.tasks(split):
        answer = getattr(task.data, "answer", None)
        if not isinstance(answer, str):
            raise ValueError(
                f"orchestrator.env[{loaded.index}] (id={loaded.config.id!r}): task data has no string "
                "`answer` field, so it cannot provide SFT references; add one to its TaskData"
            )
        pairs.append((task_messages(task.data), answer))
    return pairs


def load_env(
    entry: EnvConfig,
    index: int,
    rollout: RolloutConfig | None = None,
    env_dirs: Sequence[Path] = DEFAULT_ENV_DIRS,
) -> LoadedEnv:
    """Load ``orchestrator.env[index]``; raises ``ValueError`` naming the entry when it can't."""
    rollout = rollout or RolloutConfig()
    if entry.openenv is not None:  # an OpenEnv server, not a taskset package (openenv_env.py)
        return _load_openenv(entry, index, rollout, env_dirs)
    where = f"orchestrator.env[{index}].id = {entry.id!r}"
    prepare_imports(env_dirs)
    if entry.package is not None:  # installed first when missing (env_install.py)
        from prime_composer.orchestrator.env_install import install_package

        install_package(entry, index)
    _import_taskset_module(entry.id, where, env_dirs)
    try:
        agent = _agent_settings(entry, taskset_class(entry.id), rollout, where)
        env_config = _verifiers_env_config(entry.id, entry.args, rollout, agent)
        env = vf.load_environment(env_config)
        eval_taskset = None
        if entry.eval_args is not None:
            eval_config = taskset_config_type(entry.id).model_validate(
                {**entry.args, **entry.eval_args, "id": entry.id}
            )
            eval_taskset = vf.load_taskset(eval_config)
    except ValidationError as e:
        raise ValueError(f"{where}: invalid args or eval_args for this environment:\n{e}") from e
    return LoadedEnv(index=index, config=entry, env=env, eval_taskset=eval_taskset, agent=agent)


def _load_openenv(
    entry: EnvConfig, index: int, rollout: RolloutConfig, env_dirs: Sequence[Path]
) -> LoadedEnv:
    """An entry with an ``openenv`` table: the server's taskset (``openenv_env.py``), whose tasks
    are agentic, so its episodes run in the agent loop."""
    from prime_composer.orchestrator import openenv_env

    where = f"orchestrator.env[{index}] ({entry.label}, openenv)"
    prepare_imports(env_dirs)
    if entry.package is not None:  # an OpenEnv package, installed before its app is served
        from prime_composer.orchestrator.env_install import install_package

        install_package(entry, index)
    agent = _agent_settings(entry, openenv_env.OpenEnvTaskset, rollout, where)
    assert agent is not None  # its tasks are AgentTaskData
    fields = openenv_env.taskset_fields(entry, agent, where)  # serves an `app` first
    try:
        env = vf.load_environment(_verifiers_env_config(openenv_env.TASKSET_ID, fields, rollout, agent))
        eval_taskset = None
        if entry.eval_args is not None:
            eval_config = taskset_config_type(openenv_env.TASKSET_ID).model_validate(
                {**fields, **entry.eval_args, "id": openenv_env.TASKSET_ID}
            )
            eval_taskset = vf.load_taskset(eval_config)
    except ValidationError as e:
        raise ValueError(f"{where}: invalid openenv settings or eval_args:\n{e}") from e
    return LoadedEnv(index=index, config=entry, env=env, eval_taskset=eval_taskset, agent=agent)


def _agent_settings(
    entry: EnvConfig, taskset_type: type[vf.Taskset], rollout: RolloutConfig, where: str
) -> AgentLoopConfig | None:
    """The agent loop's settings for an environment with tool-using tasks, None for chat ones."""
    if not is_agent_taskset(taskset_type):
        if entry.agent is not None:
            raise ValueError(
                f"{where}: `agent` is set, but this environment's tasks use no tools (their data is not "
                "AgentTaskData), so its episodes are single chat calls; remove the agent table"
            )
        return None
    agent = entry.agent or AgentLoopConfig()
    if rollout.timeout_s is not None and agent.time_limit_s > rollout.timeout_s:
        raise ValueError(
            f"{where}: agent.time_limit_s = {agent.time_limit_s:g} exceeds orchestrator.rollout.timeout_s = "
            f"{rollout.timeout_s:g}, which would kill episodes before their own limit; lower the first or "
            "raise the second"
        )
    return agent


def load_envs(
    entries: Sequence[EnvConfig],
    rollout: RolloutConfig | None = None,
    env_dirs: Sequence[Path] = DEFAULT_ENV_DIRS,
) -> list[LoadedEnv]:
    """Load every ``[[orchestrator.env]]`` entry; labels must be unique."""
    if not entries:
        raise ValueError("orchestrator.env is empty; add at least one [[orchestrator.env]] with an id")
    labels = [e.label for e in entries]
    if duplicates := sorted({label for label in labels if labels.count(label) > 1}):
        raise ValueError(
            f"orchestrator.env: names {duplicates} appear more than once; give each a distinct `name`"
        )
    return [load_env(entry, i, rollout, env_dirs) for i, entry in enumerate(entries)]


def _import_taskset_module(env_id: str, where: str, env_dirs: Sequence[Path]) -> None:
    """Import the taskset package, failing with the list of what exists when it is missing."""
    module = module_name(env_id)
    local = local_environments(env_dirs)
    if module in local and importlib.util.find_spec(f"verifiers.v1.tasksets.{module}") is not None:
        raise ValueError(
            f"{where}: the local folder {local[module]} is shadowed by verifiers' built-in taskset "
            f"{module!r}; rename the folder and its package"
        )
    if (
        importlib.util.find_spec(f"verifiers.v1.tasksets.{module}") is None
        and importlib.util.find_spec(module) is None
    ):
        dirs = ", ".join(str(Path(d).resolve()) for d in env_dirs)
        raise ValueError(
            f"{where}: no such environment (looked for a folder with a package {module!r} in {dirs}, "
            f"then an installed package {module!r}). Available: {', '.join(list_environments(env_dirs))}. "
            "Fix the id, or add the environment under environments/<id>/<module>/."
        )
    loaded = importlib.import_module(module) if module not in sys.modules else sys.modules[module]
    if module in local:
        origin = Path(getattr(loaded, "__file__", "") or "").resolve()
        if local[module] not in origin.parents:
            raise ValueError(
                f"{where}: module {module!r} was already imported from {origin}, not from the local "
                f"folder {local[module]}; rename one of them"
            )


def _verifiers_env_config(
    env_id: str, args: dict[str, Any], rollout: RolloutConfig, agent: AgentLoopConfig | None
) -> vf.EnvConfig:
    """The verifiers EnvConfig for a taskset, every agent seat pinned to an offline harness."""
    config_type = env_config_type(env_id)
    harness: dict[str, Any] = {"id": chat_harness.HARNESS_ID}
    if agent is not None:
        harness = {"id": agent_harness.AGENT_HARNESS_ID, "loop": agent.model_dump(mode="json")}
    seat = {
        "harness": harness,
        "runtime": {"type": "subprocess"},
        "retries": {"max_retries": rollout.max_retries},
        "timeout": {"rollout": rollout.timeout_s},
    }
    roles = [
        name for name, field in config_type.model_fields.items() if isinstance(field.default, vf.AgentConfig)
    ]
    raw: dict[str, Any] = {"taskset": {**args, "id": env_id}, **{role: dict(seat) for role in roles}}
    return config_type.model_validate(raw)

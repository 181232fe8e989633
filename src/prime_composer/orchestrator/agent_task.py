"""What an environment with tool-using episodes declares, and what its scoring gets back.

A taskset whose tasks need a workspace and tools (a coding environment) writes its task data as
an ``AgentTaskData``: the files the episode starts from, the tools offered, the test command, and
optionally ``reference_replies`` (a known-good episode's replies, for SFT warm-up data). Its task
class declares ``AgentState`` as its state (``vf.Task[MyData, AgentState]``). Then
``prime_composer.orchestrator.envs`` runs its episodes with the agent harness, which

1. makes a fresh sandboxed workspace holding ``files`` and a ``Toolset`` over it;
2. runs the agent loop (``episode.py``);
3. leaves the workspace on ``trace.state`` (``AgentState.workspace``, with the ``sandbox``) for
   the task's ``@vf.reward`` methods to grade, and deletes it after scoring.

verifiers' own runtimes (containers, hosted sandboxes) are not pluggable from outside, so the
workspace plays the runtime's part here: the harness provisions it from the task, the task
scores in it.

Graders should not trust the episode's workspace beyond the files the task asks to change: copy
those into a fresh workspace made from the pristine ``files`` and run the tests there
(``fresh_workspace``), so edited tests, ``conftest.py`` files and leftovers do not count.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import threading
from pathlib import Path
from typing import Any, Protocol

import verifiers.v1 as vf
from pydantic import ConfigDict, Field, field_validator

from prime_composer.config.env import McpServerConfig
from prime_composer.config.sandbox import ALL_TOOLS, SandboxConfig, ToolName
from prime_composer.orchestrator.episode import Environment, Tools
from prime_composer.sandbox import Sandbox, Toolset, Workspace


class AgentTaskData(vf.TaskData):
    """Task data of an episode that uses tools on a workspace of its own."""

    files: dict[str, str] = Field(default_factory=dict)
    """The workspace the episode starts from: relative path -> text content."""
    tools: list[ToolName] = Field(default_factory=lambda: list(ALL_TOOLS))
    """Sandbox tools offered to the model, in this order (``[]`` with ``mcp_servers``: only the
    servers' tools)."""
    mcp_servers: list[McpServerConfig] = Field(default_factory=list)
    """MCP tool servers whose tools are offered after ``tools`` (``orchestrator/mcp_tools.py``);
    a stdio server runs in the episode's sandbox, so its script can be one of ``files``. Without
    ``headers_env``: task data must not choose which of the orchestrator's environment variables
    are sent to a URL it chooses (put such a server in ``orchestrator.env.agent.mcp_servers``)."""

    @field_validator("mcp_servers")
    @classmethod
    def _no_headers_env(cls, servers: list[McpServerConfig]) -> list[McpServerConfig]:
        for server in servers:
            if server.headers_env:
                raise ValueError(
                    f"mcp server {server.name!r}: headers_env is refused in task data (it would send the "
                    "orchestrator's environment variables where the task says); list the server in "
                    "orchestrator.env.agent.mcp_servers instead"
                )
        return servers

    test_command: str | None = None
    """What ``run_tests`` runs (bash -c in the workspace); needed when ``run_tests`` is offered."""
    reference_replies: list[str] | None = None
    """The assistant replies of a known-good episode, tool calls written in the harness's format;
    played against the real tools they make SFT warm-up conversations."""


class AgentState(vf.State):
    """Live objects of one episode for its scoring; never serialized."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    sandbox: Sandbox | None = None
    workspace: Workspace | None = None
    """The episode's workspace as the model left it (deleted after scoring)."""
    tools: Toolset | None = None
    """Set by a task whose ``setup`` provisions its episode itself (its own sandbox, with more
    hidden than the harness's: feature-deletion); the harness then runs this toolset, on
    ``workspace``, instead of making both from ``files``."""
    environment: Any = None
    """An ``ExternalEnvironment`` set by a task whose ``setup`` connects to an environment that
    plays the other side (OpenEnv, ``openenv_env.py``): the episode opens with its first
    observation, offers its tools (no workspace is made) and ends when it is done."""


class ExternalEnvironment(Environment, Protocol):
    """What the agent harness needs of an external environment besides ``episode.Environment``."""

    @property
    def opening(self) -> list[dict[str, Any]]:
        """The messages that open the episode (its first observation), after the system prompt."""
        ...

    @property
    def tools(self) -> Tools | None:
        """The tools it offers (actions as tool calls), or ``None``: replies are its actions."""
        ...


def is_agent_taskset(taskset_type: type[vf.Taskset]) -> bool:
    """Whether a taskset's tasks carry ``AgentTaskData`` (they are played by the agent harness)."""
    return issubclass(taskset_type.task_type().data_type(), AgentTaskData)


_sandboxes: dict[str, Sandbox] = {}
_lock = threading.Lock()


def shared_sandbox(config: SandboxConfig) -> Sandbox:
    """The process's ``Sandbox`` for ``config`` (one fork server and thread pool per config)."""
    key = config.model_dump_json()
    with _lock:
        sandbox = _sandboxes.get(key)
        if sandbox is None:
            sandbox = _sandboxes[key] = Sandbox(config)
        return sandbox


def close_sandboxes() -> None:
    """Close every shared sandbox (they are made again on next use)."""
    with _lock:
        sandboxes = list(_sandboxes.values())
        _sandboxes.clear()
    for sandbox in sandboxes:
        sandbox.close()


_SOURCES_DIR: Path | None = None


def source_dir(files: dict[str, str]) -> Path:
    """A folder holding ``files``, made once per distinct content in this process (workspaces are
    copies of it)."""
    global _SOURCES_DIR
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:24]
    with _lock:
        if _SOURCES_DIR is None:
            _SOURCES_DIR = Path(tempfile.mkdtemp(prefix="prime-composer-tasks-"))
        folder = _SOURCES_DIR / digest
        if not folder.is_dir():
            staging = Path(tempfile.mkdtemp(dir=_SOURCES_DIR))
            for relative, content in files.items():
                if Path(relative).is_absolute() or ".." in Path(relative).parts:
                    raise ValueError(
                        f"task file {relative!r}: paths must be relative and stay inside the task"
                    )
                path = staging / relative
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(content)
            staging.rename(folder)
    return folder


def fresh_workspace(sandbox: Sandbox, files: dict[str, str], overrides: dict[str, str]) -> Workspace:
    """A new workspace with the task's pristine ``files``, then ``overrides`` written over them."""
    workspace = sandbox.workspace(source_dir(files))
    for relative, content in overrides.items():
        path = workspace.resolve(relative)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        workspace.give(path)
    return workspace


MAX_GRADED_FILE_BYTES = 1 << 20
"""Larger files are not copied out of an episode's workspace for grading."""


def read_files(workspace: Workspace, paths: list[str]) -> dict[str, str]:
    """The text of ``paths`` in ``workspace``. Anything but a regular UTF-8 file of at most
    ``MAX_GRADED_FILE_BYTES`` inside the workspace (a symlink out, a FIFO the model made, a huge
    or binary file) is left out."""
    out: dict[str, str] = {}
    for relative in paths:
        try:
            path = workspace.resolve(relative)
            if not path.is_file() or path.stat().st_size > MAX_GRADED_FILE_BYTES:
                continue
            out[relative] = path.read_text()
        except (OSError, UnicodeDecodeError, ValueError):
            continue
    return out

"""SFT warm-up conversations of tool-using tasks: their reference replies played against real tools.

A task's ``reference_replies`` (``AgentTaskData``) are the assistant turns of a known-good
episode. ``play_references`` replays them in a fresh sandboxed workspace per task with the agent
loop's own ``respond`` (the same parsing, tool execution and message format as training
episodes), so the tool results in the warm-up data are what the tools really print. The result is
the conversation as the agent harness would have built it: the task's prompt, then each reply and
the tool messages it got, as an SFT record ``{"messages": [...], "tools": [...]}`` (``tools``: the
definitions the harness renders with the chat template, when ``render_tools`` is on).

A reference whose calls fail (a tool error or a failing ``run`` command), whose last test run
fails (a broken sandbox: ``python: command not found``), or that leaves the conversation
expecting more, is a bug in the environment and raises ``ValueError``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from prime_composer.config.env import AgentLoopConfig
from prime_composer.orchestrator.agent_task import AgentTaskData, close_sandboxes, shared_sandbox, source_dir
from prime_composer.orchestrator.episode import respond
from prime_composer.orchestrator.task_prompt import task_messages
from prime_composer.sandbox import Sandbox, Toolset
from prime_composer.tool_calls import get_parser


def play_references(tasks: Sequence[AgentTaskData], config: AgentLoopConfig) -> list[dict[str, Any]]:
    """One SFT record per task (see the module docstring)."""
    try:
        return asyncio.run(_play_all(tasks, config))
    finally:
        close_sandboxes()


async def _play_all(tasks: Sequence[AgentTaskData], config: AgentLoopConfig) -> list[dict[str, Any]]:
    sandbox = shared_sandbox(config.sandbox)
    return [await play_reference(task, config, sandbox) for task in tasks]


async def play_reference(
    task: AgentTaskData, config: AgentLoopConfig, sandbox: Sandbox | None = None
) -> dict[str, Any]:
    """The SFT record of ``task``'s reference replies played in a fresh workspace."""
    sandbox = sandbox or shared_sandbox(config.sandbox)
    replies = task.reference_replies or []
    if not replies:
        raise ValueError(f"task {task.id or task.idx}: no reference_replies to play")
    parser = get_parser(config.tool_call_format)
    messages = task_messages(task)
    tools_config = config.tools.model_copy(update={"enabled": list(task.tools)})
    last_tests = None
    with sandbox.workspace(source_dir(task.files)) as workspace:
        tools = Toolset(sandbox, workspace, tools_config, test_command=task.test_command)
        for k, reply in enumerate(replies):
            acted = await respond(
                messages, reply, parser, tools, config, deadline=float("inf"), clock=time.monotonic
            )
            bad = [r for r in acted.results if not r.ok or (r.name == "run" and r.nonzero_exit)]
            if acted.malformed or bad:
                problem = acted.malformed[0] if acted.malformed else bad[0].content
                raise ValueError(f"task {task.id or task.idx}: reference reply {k} fails: {problem[:300]}")
            last_tests = next((r for r in reversed(acted.results) if r.name == "run_tests"), last_tests)
            if acted.done != (k == len(replies) - 1):
                raise ValueError(
                    f"task {task.id or task.idx}: reference reply {k} "
                    + (
                        "makes no tool call before the last reply"
                        if acted.done
                        else "is last but calls a tool"
                    )
                )
        definitions = tools.definitions()
    if last_tests is not None and last_tests.nonzero_exit:
        raise ValueError(
            f"task {task.id or task.idx}: the reference's last test run fails: {last_tests.content[:300]}"
        )
    return {"messages": messages, **({"tools": definitions} if config.render_tools else {})}

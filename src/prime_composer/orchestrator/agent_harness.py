"""The agent harness: a verifiers v1 harness that plays a multi-turn, tool-using episode in-process.

``prime-composer-agent`` is what environments with ``AgentTaskData`` tasks run with (``envs.py``
pins it). ``launch``

1. makes the episode's workspace and toolset from the task (``agent_task.py``), with the tools of
   the MCP servers the task and the loop list (``mcp_tools.py``), and leaves them on
   ``trace.state`` for the task's scoring; ``cleanup`` deletes the workspace after scoring;
2. renders the task prompt with the policy's chat template (``chat_render.py``) and runs the agent
   loop (``episode.py``), sampling token-in/token-out from the inference server
   (``generate.py``): the training tokens are exactly what the model saw and produced;
3. keeps the episode record on ``trace.info[AGENT_KEY]`` (filled in while it runs), which
   ``rollout.py`` turns into Samples.

Why model calls do not go through verifiers' interception endpoint: it relays chat requests
(text in, text out), and a token-in loop needs the server's generate route. The trace therefore
holds no verifiers message graph; the conversation is on the episode record, and tasks score
from the workspace (or from ``trace.info``), not from ``trace.messages``. For the same reason
verifiers' own "rollout done" log line would count ``turns=0`` for every agent episode: a filter
drops it for this harness's traces, and ``rollout.py`` logs the line with the episode's turns.

verifiers imports a harness by a plain module name: ``envs.py`` registers this module as
``AGENT_HARNESS_MODULE``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

from prime_composer.config.env import AgentLoopConfig
from prime_composer.orchestrator.agent_task import (
    AgentState,
    AgentTaskData,
    ExternalEnvironment,
    shared_sandbox,
    source_dir,
)
from prime_composer.orchestrator.chat_render import ChatRenderer
from prime_composer.orchestrator.episode import (
    EnvironmentFailure,
    ModelCallError,
    Tools,
    new_episode,
    run_episode,
)
from prime_composer.orchestrator.generate import TokenPolicy, client_for
from prime_composer.orchestrator.mcp_tools import McpError, mcp_tools
from prime_composer.sandbox import Toolset
from prime_composer.tool_calls import get_parser

AGENT_HARNESS_ID = "prime-composer-agent"
"""The id agentic environments' seats are pinned to."""

AGENT_HARNESS_MODULE = AGENT_HARNESS_ID.replace("-", "_")
"""The module name verifiers imports for ``AGENT_HARNESS_ID``."""

AGENT_KEY = "prime_composer_agent"
"""Key of the ``AgentEpisode`` record on ``trace.info``."""

DEFAULT_MAX_REPLY_TOKENS = 1024
"""Reply cap when the sampling config sets no ``max_tokens``."""

_agent_traces: set[str] = set()
"""Ids of the traces this harness played whose verifiers "rollout done" line is still to come."""


class _NoTurnlessRolloutLine(logging.Filter):
    """Drops verifiers' "rollout done" line of an agent episode: it counts the turns of the trace's
    message graph, which agent episodes do not fill (``rollout.py`` logs the line instead)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        ours = (
            isinstance(record.msg, str)
            and record.msg.startswith("rollout done")
            and isinstance(args, tuple)
            and bool(args)
            and args[0] in _agent_traces
        )
        if ours:
            _agent_traces.discard(str(args[0]))  # type: ignore[index]
        return not ours


logging.getLogger("verifiers.v1.rollout").addFilter(_NoTurnlessRolloutLine())


def forget_trace(trace_id: str) -> None:
    """The episode is converted: its verifiers line, if it never came, is not waited for."""
    _agent_traces.discard(trace_id)


class AgentHarnessConfig(vf.HarnessConfig):
    """Config of the agent harness: the loop's budgets, tools and sandbox."""

    id: str = AGENT_HARNESS_ID
    loop: AgentLoopConfig = AgentLoopConfig()


class AgentHarness(vf.Harness[AgentHarnessConfig]):
    """Multi-turn token-in/token-out episodes with sandboxed tools (see the module docstring)."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = False
    EXECUTES_CODE = False
    """Model-directed code runs in prime_composer's sandbox, never in the verifiers runtime."""
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
        tool_interception_url: str | None = None,
    ) -> vf.ProgramResult:
        _agent_traces.add(trace.id)
        loop = self.config.loop
        sampling = ctx.sampling.model_dump(exclude_none=True)
        tokenizer = await shared_tokenizer(loop.tokenizer or ctx.model)
        renderer = ChatRenderer(tokenizer, sampling.get("chat_template_kwargs"))
        parser = get_parser(loop.tool_call_format)
        environment: ExternalEnvironment | None = getattr(trace.state, "environment", None)
        tools: Tools | None
        if environment is not None:
            tools, messages = environment.tools, self._messages(data, environment.opening)
        else:
            tools, messages = await self._open_tools(trace, trace.task.data), self._messages(data)
        client = client_for(ctx.client.base_url, ctx.client.api_key_var, loop.request)
        limits = [n for n in (loop.max_context_tokens, await client.max_model_len()) if n is not None]
        episode = new_episode(messages, tools.definitions() if tools else [], loop)
        trace.info[AGENT_KEY] = episode  # visible to scoring even if the rollout timeout cancels us
        try:
            await run_episode(
                TokenPolicy(client, ctx.model, sampling),
                renderer,
                parser,
                episode.messages,
                tools,
                loop,
                max_reply_tokens=int(sampling.get("max_tokens") or DEFAULT_MAX_REPLY_TOKENS),
                max_context_tokens=min(limits) if limits else None,
                episode=episode,
                environment=environment,
            )
        except ModelCallError as e:
            raise vf.HarnessError(f"model call failed: {e}") from e
        except EnvironmentFailure as e:
            raise vf.HarnessError(f"environment failed: {e}") from e
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")

    async def cleanup(self, trace: vf.Trace, runtime: vf.Runtime) -> None:
        state = trace.state
        if isinstance(state, AgentState) and state.workspace is not None:
            workspace, state.workspace = state.workspace, None
            await asyncio.to_thread(workspace.close)

    def _messages(
        self, data: vf.TaskData, opening: list[dict[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        """The system prompt, then ``opening`` (an external environment's first observation) or
        else the task's prompt."""
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if opening is not None:
            messages.extend(dict(m) for m in opening)
        elif isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages.extend(message_to_wire(m) for m in prompt or [])
        return messages

    async def _open_tools(self, trace: vf.Trace, task: vf.TaskData) -> Toolset | None:
        """The episode's toolset on a fresh workspace (None for a task without ``AgentTaskData``)."""
        if not isinstance(task, AgentTaskData):
            return None
        if not isinstance(trace.state, AgentState):
            raise vf.HarnessError(
                f"task {trace.task.type} has AgentTaskData but its state is {type(trace.state).__name__}: "
                "declare it as vf.Task[<data>, AgentState] so scoring can see the workspace"
            )
        if trace.state.tools is not None:  # the task's setup provisioned the episode
            return trace.state.tools
        loop = self.config.loop
        sandbox = await asyncio.to_thread(shared_sandbox, loop.sandbox)
        workspace = await asyncio.to_thread(sandbox.workspace, source_dir(task.files))
        trace.state.sandbox, trace.state.workspace = sandbox, workspace
        tools_config = loop.tools.model_copy(update={"enabled": list(task.tools)})
        servers = [*task.mcp_servers, *loop.mcp_servers]
        try:
            extra = await asyncio.to_thread(mcp_tools, servers, sandbox, workspace) if servers else []
        except McpError as e:
            raise vf.HarnessError(str(e)) from e
        return Toolset(sandbox, workspace, tools_config, test_command=task.test_command, extra_tools=extra)


_tokenizers: dict[str, Any] = {}
_tokenizer_lock = threading.Lock()


async def shared_tokenizer(name: str) -> Any:
    """The tokenizer of ``name`` (a hub id, a local folder or ``builtin:...``), loaded once."""
    if name not in _tokenizers:
        await asyncio.to_thread(_load_tokenizer, name)
    return _tokenizers[name]


def _load_tokenizer(name: str) -> None:
    from prime_composer.model.resolve import load_tokenizer

    with _tokenizer_lock:
        if name not in _tokenizers:
            _tokenizers[name] = load_tokenizer(name)


__all__ = ["AgentHarness", "AgentHarnessConfig"]

"""OpenEnv environments as orchestrator environments: an ``[[orchestrator.env]]`` with an ``openenv``
table (``config/env.py``'s ``OpenEnvConfig``) trains on an OpenEnv server.

The entry becomes a verifiers v1 taskset of this module (``OpenEnvTaskset``, registered as
``TASKSET_MODULE``), one task per ``reset``, whose data is an ``AgentTaskData`` without tools: the
episodes run in the project's own agent loop (``agent_harness.py`` -> ``episode.py``), token-in
and token-out, so samples, multi-turn segments, SDPO targets and error samples are exactly those
of the other agentic environments. Per episode:

1. the task's ``setup`` opens an OpenEnv session (``OpenEnvSession``: openenv's
   ``GenericEnvClient``, one WebSocket session, so the server keeps the episode's state), reads the
   action's JSON schema from ``/schema`` and resets the environment; the session is the episode's
   ``ExternalEnvironment`` (``AgentState.environment``);
2. the first observation opens the conversation (a ``user`` turn, with how to write an action);
3. actions come from the policy's replies: for a plain environment the reply itself, read as a
   JSON object of the action's fields (or, for an action with one required field, its bare value)
   and stepped; the observation comes back as the next ``user`` turn. For an environment whose
   actions are MCP tool calls (OpenEnv's ``MCPEnvironment``: ``CallToolAction``), its tools are
   offered (``OpenEnvTools``: rendered, parsed, argument-checked, capped and recorded like the
   sandbox's tools) and each tool call is one ``call_tool`` step, its result the tool message;
4. the episode ends when the environment says ``done``, when a reply to an MCP environment calls
   no tool, or at a budget of the agent loop; the reward ``openenv_reward`` is the sum of the
   steps' rewards.

A bad action (not JSON, fields the schema does not have, a server-side validation error) is an
observation the model sees ("Error: ..."), counted in ``openenv_invalid_actions``; a server that
cannot be reached or stops answering fails the episode, which becomes an error sample.

With ``app`` the orchestrator serves the environment package itself (``serve_app``): uvicorn on a
free port of 127.0.0.1, started once per process when the entry loads and stopped with it. With
``image`` it runs the container image with docker or podman (``openenv_container.py``), with
``space`` it talks to the Hugging Face Space's ``https://owner-name.hf.space`` as to a ``url``.
A private Space (or any https server behind a bearer token) gets the token of the variable
``token_env`` names in an ``Authorization`` header (``auth_headers``), over https only.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import verifiers.v1 as vf
from pydantic import Field

from prime_composer.config.env import AgentLoopConfig, EnvConfig, OpenEnvConfig
from prime_composer.config.ports import free_port
from prime_composer.health import wait_healthy
from prime_composer.orchestrator.agent_task import AgentState, AgentTaskData
from prime_composer.orchestrator.episode import EnvironmentFailure
from prime_composer.process_group import die_with_parent, stop_group
from prime_composer.sandbox.files import ToolError
from prime_composer.sandbox.output import truncate_middle
from prime_composer.sandbox.tools import Tool, ToolCallRecord, ToolResult, validate_arguments

TASKSET_ID = "prime-composer-openenv"
"""The verifiers taskset id an ``openenv`` entry loads as."""

TASKSET_MODULE = TASKSET_ID.replace("-", "_")
"""The module name verifiers imports for ``TASKSET_ID`` (this module, registered in ``sys.modules``)."""

MCP_ACTION_TITLES = frozenset({"Action", "CallToolAction", "ListToolsAction"})
"""Action schema titles of OpenEnv's MCP environments (actions are tool calls)."""

DEFAULT_MAX_RESULT_BYTES = 16_384
"""Cap of one tool result or observation the model sees (``agent.tools.max_result_bytes`` sets it)."""


def _one_plain_reset() -> list[dict[str, Any]]:
    """One task: ``reset()`` without arguments."""
    return [{}]


class OpenEnvError(EnvironmentFailure):
    """The OpenEnv server could not be reached, or broke the protocol (the episode fails)."""


# -- the session: one episode against the server ---------------------------------------------


class OpenEnvSession:
    """One episode's WebSocket session with an OpenEnv server; an ``ExternalEnvironment``."""

    def __init__(self, client: Any, action_schema: dict[str, Any], tool_specs: list[dict[str, Any]] | None):
        self._client = client
        self.action_schema = action_schema
        self.tool_specs = tool_specs
        """The MCP tools the environment offers, or ``None`` for a plain environment."""
        self.total_reward = 0.0
        self.num_steps = 0
        self.num_invalid = 0
        self._done = False
        self._opening: list[dict[str, Any]] = []
        self._tools: OpenEnvTools | None = None
        self._closed = False

    @classmethod
    async def open(
        cls, url: str, reset: dict[str, Any], source: OpenEnvConfig, max_result_bytes: int
    ) -> OpenEnvSession:
        """Connect, read the schema (and the tools of an MCP environment) and reset."""
        from openenv import GenericEnvClient

        headers = auth_headers(source, url)
        action_schema = await _action_schema(url, source.connect_timeout_s, headers)
        client = GenericEnvClient(
            base_url=url,
            connect_timeout_s=source.connect_timeout_s,
            message_timeout_s=source.step_timeout_s,
            headers=headers,
        )
        session = cls(client, action_schema, None)
        try:
            await client.connect()
            if is_mcp_action(action_schema):
                listed = await client.step({"type": "list_tools"})
                session.tool_specs = list((listed.observation or {}).get("tools") or [])
            result = await client.reset(**reset)
        except Exception as e:  # the client raises ConnectionError, RuntimeError, websockets' errors
            await session.close()
            raise OpenEnvError(
                f"openenv server {url}: opening an episode failed ({type(e).__name__}: {e})"
            ) from e
        session._done = bool(result.done)
        observation = observation_text(result.observation, max_result_bytes)
        if session.tool_specs is None and source.describe_action:
            observation += "\n\n" + action_instructions(action_schema)
        session._opening = [{"role": "user", "content": observation}]
        if session.tool_specs is not None:
            session._tools = OpenEnvTools(session, session.tool_specs, max_result_bytes)
        session._max_result_bytes = max_result_bytes
        return session

    _max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES

    @property
    def opening(self) -> list[dict[str, Any]]:
        return self._opening

    @property
    def tools(self) -> OpenEnvTools | None:
        return self._tools

    @property
    def done(self) -> bool:
        return self._done

    async def act(self, text: str) -> str | None:
        """Step a plain environment with the reply ``text``; the observation, or an error the model
        sees. An MCP environment's reply without a tool call ends the episode (``None``)."""
        if self.tool_specs is not None:
            return None
        try:
            action = parse_action(text, self.action_schema)
        except ValueError as e:
            self.num_invalid += 1
            return f"Error: {e}\n\n{action_instructions(self.action_schema)}"
        outcome = await self._step(action)
        if isinstance(outcome, str):
            return outcome
        return observation_text(outcome, self._max_result_bytes)

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> tuple[str, str | None]:
        """One ``call_tool`` step: the text for the model and the error kind (``None`` if it worked)."""
        outcome = await self._step({"type": "call_tool", "tool_name": name, "arguments": arguments})
        if isinstance(outcome, str):
            return outcome, "invalid_action"
        error = outcome.get("error")
        if isinstance(error, dict):
            return f"Error: {error.get('message') or error}", str(error.get("error_type") or "openenv_error")
        result = outcome.get("result")
        text = tool_result_text(result)
        if isinstance(result, dict) and (result.get("is_error") or result.get("isError")):
            return text, "mcp_tool_error"
        return text, None

    async def _step(self, action: dict[str, Any]) -> dict[str, Any] | str:
        """Step; the observation dict, or an error message when the server refused the action."""
        try:
            result = await self._client.step(action)
        except RuntimeError as e:
            # GenericEnvClient reports the server's error answers (a validation error, say) as
            # RuntimeError("Server error: ..."); the session stays open.
            if not str(e).startswith("Server error"):
                raise OpenEnvError(f"openenv step failed: {e}") from e
            self.num_invalid += 1
            return f"Error: the environment refused this action ({e})."
        except Exception as e:
            raise OpenEnvError(f"openenv step failed ({type(e).__name__}: {e})") from e
        self.num_steps += 1
        self.total_reward += float(result.reward or 0.0)
        self._done = bool(result.done)
        return dict(result.observation or {})

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Closing a session that broke must not fail the rollout a second time.
        with contextlib.suppress(Exception):
            await self._client.close()


def auth_headers(source: OpenEnvConfig, url: str) -> dict[str, str] | None:
    """The ``Authorization`` header of ``source.token_env`` for ``url`` (``None`` without one).

    Only for an ``https://`` URL (the config refuses plain http too; this is the last check before
    a token leaves). httpx follows no redirect here, and websockets drops ``Authorization`` on a
    redirect to another origin, so the token reaches the entry's own host only. The value is read
    from the environment at each call and appears in no message."""
    if source.token_env is None:
        return None
    if not url.startswith("https://"):
        raise OpenEnvError(f"openenv server {url}: token_env is set, and a token is only sent over https")
    token = os.environ.get(source.token_env, "").strip()
    if not token:
        raise OpenEnvError(
            f"openenv server {url}: openenv.token_env names {source.token_env}, which is not set in the "
            "orchestrator's environment"
        )
    websockets_log = logging.getLogger("websockets.client")
    if not any(isinstance(f, _HideCredentials) for f in websockets_log.filters):
        websockets_log.addFilter(_HideCredentials())
    return {"Authorization": f"Bearer {token}"}


class _HideCredentials(logging.Filter):
    """websockets logs every handshake header at DEBUG (``> %s: %s``): the credentials' values are
    replaced before the record is written."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        header = args[0] if record.msg == "> %s: %s" and isinstance(args, tuple) and len(args) == 2 else None
        if str(header).lower() in ("authorization", "cookie", "proxy-authorization"):
            record.args = (header, "<hidden>")
        return True


_schemas: dict[str, dict[str, Any]] = {}


async def _action_schema(url: str, timeout_s: float, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """The action's JSON schema from the server's ``/schema``, asked once per server and process
    (a new HTTP client per episode cost ~0.1 s, most of an episode's own time)."""
    if url not in _schemas:
        try:
            async with httpx.AsyncClient(timeout=timeout_s, headers=headers, follow_redirects=False) as http:
                response = await http.get(f"{url.rstrip('/')}/schema")
                response.raise_for_status()
                schema = response.json()["action"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            raise OpenEnvError(f"openenv server {url}: GET /schema failed ({type(e).__name__}: {e})") from e
        if not isinstance(schema, dict):
            raise OpenEnvError(f"openenv server {url}: /schema has no action schema object")
        _schemas[url] = schema
    return _schemas[url]


class OpenEnvTools:
    """An MCP environment's tools for the agent loop (``episode.Tools``): each call one step."""

    def __init__(self, session: OpenEnvSession, specs: list[dict[str, Any]], max_result_bytes: int):
        self.session = session
        self.max_result_bytes = max_result_bytes
        self.records: list[ToolCallRecord] = []
        self.tools: dict[str, Tool] = {}
        for spec in specs:
            name = str(spec.get("name"))
            schema = (
                spec.get("input_schema") or spec.get("inputSchema") or {"type": "object", "properties": {}}
            )
            description = spec.get("description") or f"The environment's {name} tool."
            self.tools[name] = Tool(name, description, schema, _not_local, external=True)

    def definitions(self) -> list[dict[str, Any]]:
        return [tool.definition() for tool in self.tools.values()]

    async def call_async(self, name: str, arguments: str | dict[str, Any] | None) -> ToolResult:
        start = time.monotonic()
        raw = arguments if isinstance(arguments, str) else json.dumps(arguments or {})
        text, error = await self._call(name, raw)
        content, cut = truncate_middle(text, self.max_result_bytes)
        record = ToolCallRecord(
            name=name,
            arguments=raw,
            ok=error is None,
            error=error,
            duration_s=time.monotonic() - start,
            result_bytes=len(content.encode()),
            truncated=cut,
        )
        self.records.append(record)
        return ToolResult(content, record)

    async def _call(self, name: str, raw: str) -> tuple[str, str | None]:
        tool = self.tools.get(name)
        if tool is None:
            available = ", ".join(self.tools) or "none"
            return f"Error: there is no tool named {name!r}. Available tools: {available}.", "unknown_tool"
        try:
            args = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as e:
            return (
                f"Error: the arguments of {name} are not valid JSON ({e.msg} at position {e.pos}).",
                "invalid_json",
            )
        try:
            validate_arguments(tool, args)
        except ToolError as e:
            return f"Error: {e}", e.kind
        return await self.session.call_tool(name, args)


def _not_local(**_: Any) -> tuple[str, None]:
    raise ToolError("internal_error", "an OpenEnv tool runs on the environment's server")


# -- reading and writing the environment's messages ------------------------------------------


def is_mcp_action(action_schema: dict[str, Any]) -> bool:
    """Whether the environment's actions are MCP tool calls (OpenEnv's ``MCPEnvironment`` serves
    ``CallToolAction``, or the generic ``Action``, as its action schema)."""
    return action_schema.get("title") in MCP_ACTION_TITLES


def parse_action(text: str, action_schema: dict[str, Any]) -> dict[str, Any]:
    """A reply as an action: a JSON object (fenced or not) of the action's fields, or the bare value
    of an action with exactly one required field. Raises ``ValueError`` saying what is wrong."""
    body = text.strip()
    if body.startswith("```") and body.endswith("```") and "\n" in body:
        body = "\n".join(body.splitlines()[1:-1]).strip()
    try:
        value: Any = json.loads(body)
    except json.JSONDecodeError:
        value = None
    properties = set((action_schema.get("properties") or {}).keys())
    required = list(action_schema.get("required") or [])
    if isinstance(value, dict):
        unknown = (
            sorted(set(value) - properties) if action_schema.get("additionalProperties") is False else []
        )
        if unknown:
            raise ValueError(
                f"the action has no field {unknown[0]!r} (fields: {', '.join(sorted(properties))})"
            )
        missing = [name for name in required if name not in value]
        if missing:
            raise ValueError(f"the action needs the field {missing[0]!r}")
        return value
    if len(required) != 1:
        raise ValueError("the reply is not a JSON object of the action's fields")
    if not body:
        raise ValueError("the reply is empty, so it is no action")
    field = required[0]
    kind = ((action_schema.get("properties") or {}).get(field) or {}).get("type")
    return {field: body if kind in (None, "string") or value is None else value}


def action_instructions(action_schema: dict[str, Any]) -> str:
    """How to write an action, from its JSON schema (the ``metadata`` field left out)."""
    properties = {k: v for k, v in (action_schema.get("properties") or {}).items() if k != "metadata"}
    fields = ", ".join(
        f"{name} ({spec.get('type', 'any')}{', required' if name in (action_schema.get('required') or []) else ''})"
        for name, spec in properties.items()
    )
    required = list(action_schema.get("required") or [])
    single = f", or just the value of {required[0]}" if len(required) == 1 else ""
    return f"Reply with your action: a JSON object with the fields {fields}{single}."


def observation_text(observation: dict[str, Any] | None, max_bytes: int) -> str:
    """What the model sees of an observation: its one text field, else its fields as JSON
    (``done``, ``reward`` and an empty ``metadata`` left out), capped at ``max_bytes``."""
    fields = {
        k: v
        for k, v in (observation or {}).items()
        if k not in ("done", "reward") and not (k == "metadata" and not v)
    }
    if len(fields) == 1 and isinstance(next(iter(fields.values())), str):
        text = next(iter(fields.values()))
    else:
        text = json.dumps(fields, ensure_ascii=False, default=str)
    return truncate_middle(text, max_bytes)[0]


def tool_result_text(result: Any) -> str:
    """An MCP tool result's text parts joined (its data as JSON when it has none)."""
    if isinstance(result, dict):
        parts = [
            c.get("text", "")
            for c in result.get("content") or []
            if isinstance(c, dict) and c.get("type") == "text"
        ]
        if parts:
            return "\n".join(parts)
        if result.get("data") is not None:
            return json.dumps(result["data"], ensure_ascii=False, default=str)
    return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)


# -- the verifiers taskset -------------------------------------------------------------------


class OpenEnvTaskConfig(vf.TasksetConfig):
    """The taskset of one ``openenv`` entry (``OpenEnvConfig`` with the server's resolved ``url``)."""

    url: str
    source: str = ""
    """What the entry names (its url or app), kept on the tasks instead of the run's port."""
    resets: list[dict[str, Any]] = Field(default_factory=_one_plain_reset)
    system_prompt: str | None = None
    describe_action: bool = True
    connect_timeout_s: float = 30.0
    step_timeout_s: float = 60.0
    token_env: str | None = None
    """The variable's name only (the token is read at each episode, never kept in a config)."""
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES


class OpenEnvData(AgentTaskData):
    """One reset of an OpenEnv environment; the prompt is replaced by its first observation."""

    source: str
    reset: dict[str, Any] = Field(default_factory=dict)


class OpenEnvState(AgentState):
    """The agent harness's state plus the episode's session (never serialized)."""

    session: OpenEnvSession | None = None


class OpenEnvTask(vf.Task[OpenEnvData, OpenEnvState]):
    """An episode against the server: ``setup`` opens the session, the reward sums its steps'."""

    url: str = ""
    source_config: OpenEnvConfig | None = None
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES

    async def setup(self, trace: vf.Trace, runtime: vf.Runtime) -> None:
        state = trace.state
        if not isinstance(state, OpenEnvState) or self.source_config is None:
            raise vf.TaskError("an OpenEnv task needs its OpenEnvState and the entry's openenv config")
        try:
            session = await OpenEnvSession.open(
                self.url, self.data.reset, self.source_config, self.max_result_bytes
            )
        except OpenEnvError as e:
            raise vf.TaskError(str(e)) from e
        state.session = state.environment = session

    async def finalize(self, trace: vf.Trace, runtime: vf.Runtime) -> None:
        session = getattr(trace.state, "session", None)
        if session is not None:
            await session.close()

    @vf.reward(weight=1.0)
    async def openenv_reward(self, trace: vf.Trace) -> float:
        session = getattr(trace.state, "session", None)
        if session is None:
            return 0.0
        await session.close()
        return session.total_reward

    @vf.metric
    async def openenv_steps(self, trace: vf.Trace) -> float:
        session = getattr(trace.state, "session", None)
        return float(session.num_steps) if session is not None else 0.0

    @vf.metric
    async def openenv_invalid_actions(self, trace: vf.Trace) -> float:
        session = getattr(trace.state, "session", None)
        return float(session.num_invalid) if session is not None else 0.0

    @vf.metric
    async def openenv_done(self, trace: vf.Trace) -> float:
        session = getattr(trace.state, "session", None)
        return float(session is not None and session.done)


class OpenEnvTaskset(vf.Taskset[OpenEnvTask, OpenEnvTaskConfig]):
    def load(self) -> list[OpenEnvTask]:
        config = self.config
        source = OpenEnvConfig(
            url=config.url,
            resets=config.resets,
            system_prompt=config.system_prompt,
            describe_action=config.describe_action,
            connect_timeout_s=config.connect_timeout_s,
            step_timeout_s=config.step_timeout_s,
            token_env=config.token_env,
        )
        tasks = []
        for idx, reset in enumerate(config.resets):
            data = OpenEnvData(
                name=f"{config.source or config.url}#{idx}",
                id=f"{config.source or config.url}#{idx}",
                prompt=f"(the first observation of {config.source or config.url} after reset {json.dumps(reset)})",
                system_prompt=config.system_prompt,
                tools=[],
                source=config.source or config.url,
                reset=reset,
            )
            task = OpenEnvTask(data, config.task)
            task.url, task.source_config, task.max_result_bytes = config.url, source, config.max_result_bytes
            tasks.append(task)
        return tasks


__all__ = ["OpenEnvTaskset"]


# -- loading an entry, serving an app --------------------------------------------------------


def taskset_fields(entry: EnvConfig, agent: AgentLoopConfig, where: str) -> dict[str, Any]:
    """The ``OpenEnvTaskConfig`` fields of an entry (``envs.py`` loads it), its ``app`` served
    first; registers this module under ``TASKSET_MODULE`` for verifiers to import."""
    source = entry.openenv
    assert source is not None
    sys.modules.setdefault(TASKSET_MODULE, sys.modules[__name__])
    if source.image is not None:
        from prime_composer.orchestrator.openenv_container import serve_image

        url = serve_image(source, where)
    elif source.app is not None:
        url = serve_app(source, where)
    else:
        url = source.url or source.space_url or ""
    if source.token_env is not None and not os.environ.get(source.token_env, "").strip():
        raise ValueError(
            f"{where}: openenv.token_env = {source.token_env!r}, and that variable is not set in the "
            f"orchestrator's environment; export {source.token_env} (a token that can read {source.source})"
        )
    kept = {"resets", "system_prompt", "describe_action", "connect_timeout_s", "step_timeout_s", "token_env"}
    return {
        **source.model_dump(include=kept),
        "url": url,
        "source": source.source,
        "max_result_bytes": agent.tools.max_result_bytes,
    }


_served: dict[tuple[str, str | None], str] = {}


def serve_app(source: OpenEnvConfig, where: str = "openenv") -> str:
    """Serve ``source.app`` with uvicorn on a free port of 127.0.0.1 (once per process and app);
    its URL. The server dies with this process; one that does not come up is an error with its log."""
    assert source.app is not None
    key = (source.app, source.app_dir)
    if key in _served:
        return _served[key]
    port = free_port("127.0.0.1")
    env = dict(os.environ)
    cwd = None
    if source.app_dir is not None:
        cwd = str(Path(source.app_dir).resolve())
        if not Path(cwd).is_dir():
            raise ValueError(f"{where}: openenv.app_dir = {source.app_dir!r} is not a folder")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (cwd, env.get("PYTHONPATH")) if p)
    log = tempfile.NamedTemporaryFile(prefix="prime-composer-openenv-", suffix=".log", delete=False)  # noqa: SIM115
    command = [sys.executable, "-m", "uvicorn", source.app, "--host", "127.0.0.1", "--port", str(port)]
    child = subprocess.Popen(
        [*command, "--log-level", "warning"],
        cwd=cwd,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    atexit.register(stop_group, child, 10.0)
    url = f"http://127.0.0.1:{port}"
    waited = wait_healthy(
        f"{url}/health",
        source.startup_timeout_s,
        poll_s=0.2,
        give_up=lambda: None if child.poll() is None else "exited",
    )
    if not waited.healthy:
        stop_group(child, 5.0)
        tail = Path(log.name).read_text(errors="replace")[-2000:]
        state = f"exited with {child.returncode}" if child.returncode is not None else "did not answer"
        raise ValueError(
            f"{where}: the OpenEnv app {source.app!r} {state} within {source.startup_timeout_s:g} s "
            f"(openenv.startup_timeout_s); its log {log.name} ends:\n{tail}"
        )
    _served[key] = url
    return url

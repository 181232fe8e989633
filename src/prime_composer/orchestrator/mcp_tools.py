"""MCP tool servers as agent tools: their tools become ``Tool``s of the episode's ``Toolset``.

An agent task (``AgentTaskData.mcp_servers``) or the agent loop (``AgentLoopConfig.mcp_servers``)
lists servers; ``mcp_tools`` asks each for its tools (``tools/list``) and wraps every tool as a
``prime_composer.sandbox.Tool``, so an MCP tool is rendered, parsed, argument-checked, capped,
timed, locked and recorded exactly like ``read_file`` (``sandbox/tools.py``). A tool's failure
(``isError``, a JSON-RPC error, a server that crashed or timed out) is a tool result the model
sees, never an exception out of the episode.

Two transports:

- **stdio** (``command``): the server runs *in the episode's sandbox*, in its workspace, as the
  workspace's user, without network, under the sandbox's limits. With ``lifetime = "episode"``
  (the default, ``_EpisodeClient``) one server process serves the whole episode:
  ``Sandbox.start`` starts it at the episode's first MCP call (the ``initialize`` handshake is
  part of that call and its ``timeout_s``), every call is one JSON-RPC request on its stdin and
  the answer on its stdout, and ``Workspace.close`` stops it. The file tools are safe only while
  no sandboxed process of the workspace runs (``sandbox/files.py``), so the server is SIGSTOPped
  between its calls (``ServerProcess.pause``: every process of the workspace's uid, until each
  is stopped) and continued for the next; ``Toolset`` runs one call at a time per workspace. A
  server that dies, times out (it is killed) or sends a line past the output limit is a tool
  error the model sees, and the next call starts it again, at most ``max_restarts`` times per
  episode. Concurrent episodes have their own workspaces, so their own servers. With
  ``lifetime = "call"`` (``_PerCallClient``) each call is one sandbox run of a small relay
  (``_RELAY``, stdlib only) that starts the server, sends ``initialize``,
  ``notifications/initialized`` and the request, waits for the answer and then closes the
  server's stdin (closing it right after the request is not enough: the SDK's servers cancel
  requests still in flight at end of input); nothing survives a call but the workspace's files,
  and each call pays the server's start-up (``bench/mcp_stdio.py``). The tool list of a command
  is asked once per process.
- **streamable HTTP** (``url``): a server that is already running; each call opens a session with
  the ``mcp`` SDK's client from the orchestrator's process (not sandboxed), sending the headers of
  ``headers_env`` (values read from environment variables at the call, never logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from mcp_types import CallToolResult, ListToolsResult
from pydantic import ValidationError

from prime_composer.config.env import McpServerConfig
from prime_composer.sandbox import RunResult, Sandbox, SandboxError, Workspace, format_run
from prime_composer.sandbox.files import ToolError
from prime_composer.sandbox.server import ServerGone, ServerProcess
from prime_composer.sandbox.tools import Tool

PROTOCOL_VERSION = "2025-06-18"
"""The MCP protocol version this client speaks (the handshake protocol; servers of the 2.x SDK
and older ones accept it)."""

logger = logging.getLogger(__name__)

CLIENT_INFO = {"name": "prime-composer", "version": "0.1.0"}

_RELAY = r"""
import json, subprocess, sys
requests = [line for line in sys.stdin.buffer.read().splitlines() if line.strip()]
waiting = {json.loads(line)["id"] for line in requests if "id" in json.loads(line)}
server = subprocess.Popen(sys.argv[1:], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
for line in requests:
    server.stdin.write(line + b"\n")
server.stdin.flush()
for line in server.stdout:
    sys.stdout.buffer.write(line)
    sys.stdout.flush()
    try:
        message = json.loads(line)
    except ValueError:
        continue
    if isinstance(message, dict) and ("result" in message or "error" in message):
        waiting.discard(message.get("id"))
    if not waiting:
        break
server.stdin.close()
try:
    sys.exit(server.wait(timeout=2))
except subprocess.TimeoutExpired:
    server.kill()
"""
"""Runs in the sandbox: feeds the server its requests and ends it once each has its answer."""


class McpError(Exception):
    """A server that could not be asked for its tools (at episode start: the episode fails)."""


def mcp_tools(servers: Sequence[McpServerConfig], sandbox: Sandbox, workspace: Workspace) -> list[Tool]:
    """The tools of ``servers`` for an episode on ``workspace``; raises ``McpError`` when a
    server does not answer ``tools/list``."""
    names = [server.name for server in servers]
    if len(set(names)) != len(names):
        raise ValueError(f"mcp servers: two servers share a name in {names}; names must be unique")
    tools: list[Tool] = []
    for server in servers:
        client: _Client
        if server.command is None:
            client = _HttpClient(server)
        elif server.lifetime == "call":
            client = _PerCallClient(server, sandbox, workspace)
        else:
            client = _EpisodeClient(server, sandbox, workspace)
        listed = client.list_tools()
        offered = {tool["name"]: tool for tool in listed}
        if server.tools is not None:
            missing = [name for name in server.tools if name not in offered]
            if missing:
                raise McpError(
                    f"mcp server {server.name!r} has no tool {missing[0]!r} (it lists: "
                    f"{', '.join(offered) or 'none'}); fix its `tools` list"
                )
            offered = {name: offered[name] for name in server.tools}
        for name, spec in offered.items():
            schema = spec.get("inputSchema") or {"type": "object", "properties": {}}
            tools.append(
                Tool(
                    name,
                    spec.get("description") or f"The {name} tool of the {server.name} MCP server.",
                    schema,
                    _handler(client, name),
                    external=True,
                )
            )
    return tools


def _handler(client: _Client, name: str) -> Any:
    def call(**arguments: Any) -> tuple[str, RunResult | None]:
        return client.call_tool(name, arguments)

    return call


class _Client:
    config: McpServerConfig

    def list_tools(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def call_tool(self, name: str, arguments: dict[str, Any]) -> tuple[str, RunResult | None]:
        raise NotImplementedError


_listed: dict[str, list[dict[str, Any]]] = {}
_listed_lock = threading.Lock()


def _initialize() -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": 0,
        "method": "initialize",
        "params": {"protocolVersion": PROTOCOL_VERSION, "capabilities": {}, "clientInfo": CLIENT_INFO},
    }


_INITIALIZED = {"jsonrpc": "2.0", "method": "notifications/initialized"}


def _tool_list(name: str, result: dict[str, Any] | None, why: str) -> list[dict[str, Any]]:
    """The tools of a ``tools/list`` result; ``McpError`` when there is none or it is invalid."""
    if result is None:
        raise McpError(f"mcp server {name!r}: tools/list failed: {why}")
    try:
        return [
            tool.model_dump(mode="json", exclude_none=True, by_alias=True)
            for tool in ListToolsResult.model_validate(result).tools
        ]
    except ValidationError as e:
        raise McpError(f"mcp server {name!r}: tools/list sent an invalid answer: {e}") from e


def _refused(server: str, message: dict[str, Any]) -> ToolError:
    return ToolError(
        "mcp_error", f"the {server} MCP server refused the call: {message['error'].get('message')}"
    )


class _EpisodeClient(_Client):
    """One server process for the episode, paused between its calls (see the module docstring)."""

    def __init__(self, config: McpServerConfig, sandbox: Sandbox, workspace: Workspace) -> None:
        self.config, self.sandbox, self.workspace = config, sandbox, workspace
        self.limits = sandbox.config.limits.model_copy(update={"timeout_s": config.timeout_s})
        self.server: ServerProcess | None = None
        self.num_starts = 0
        self._next_id = 1
        self._lock = threading.Lock()

    def list_tools(self) -> list[dict[str, Any]]:
        key = json.dumps(self.config.command)
        with _listed_lock:
            if key in _listed:
                return _listed[key]
        try:
            result = self._request("tools/list", {})
        except ToolError as e:
            raise McpError(f"mcp server {self.config.name!r}: tools/list failed: {e}") from e
        tools = _tool_list(self.config.name, result, "no result")
        with _listed_lock:
            _listed[key] = tools
        return tools

    def call_tool(self, name: str, arguments: dict[str, Any]) -> tuple[str, RunResult | None]:
        result = self._request("tools/call", {"name": name, "arguments": arguments})
        if result is None:
            raise ToolError("mcp_error", f"the {self.config.name} MCP server sent an answer without a result")
        return _render(self.config.name, result), None

    def _request(self, method: str, params: dict[str, Any]) -> dict[str, Any] | None:
        """The ``result`` of one request on the episode's server (started here if need be)."""
        with self._lock:
            deadline = time.monotonic() + self.config.timeout_s
            server = self._server(deadline)
            server.resume()
            try:
                request_id, self._next_id = self._next_id, self._next_id + 1
                message = self._exchange(
                    server, {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}, deadline
                )
            except TimeoutError:
                server.close(f"killed: a call took longer than timeout_s = {self.config.timeout_s:g} s")
                raise ToolError(
                    "timeout",
                    f"timed out after {self.config.timeout_s:g} s; the {self.config.name} MCP server was "
                    f"stopped{self._restart_note()}",
                ) from None
            except ServerGone:
                server.close()
                raise ToolError(
                    "mcp_server_died",
                    f"the {self.config.name} MCP server ended ({server.describe()}){self._restart_note()}",
                ) from None
            finally:
                # Paused until its next call; one that does not stop is killed (the next call
                # starts a new one), so no sandboxed process runs while a file tool works.
                if server.alive and not server.pause():
                    logger.warning("mcp server %r: %s", self.config.name, server.describe())
            if isinstance(message.get("error"), dict):
                raise _refused(self.config.name, message)
            result = message.get("result")
            return result if isinstance(result, dict) else None

    def _server(self, deadline: float) -> ServerProcess:
        """The running server, or a new one that has done the ``initialize`` handshake."""
        if self.server is not None and self.server.alive:
            return self.server
        if self.num_starts > self.config.max_restarts:
            raise ToolError(
                "mcp_server_died",
                f"the {self.config.name} MCP server ended {self.num_starts} times in this episode "
                f"(max_restarts = {self.config.max_restarts}); its tools are unavailable now",
            )
        assert self.config.command is not None
        self.num_starts += 1
        try:
            self.server = server = self.sandbox.start(self.workspace, self.config.command, limits=self.limits)
        except SandboxError as e:
            raise ToolError("mcp_error", f"the {self.config.name} MCP server could not start: {e}") from e
        try:
            answer = self._exchange(server, _initialize(), deadline)
            if "result" not in answer:
                raise ServerGone(f"it refused initialize: {answer.get('error')}")
            server.send(json.dumps(_INITIALIZED).encode() + b"\n", deadline)
        except TimeoutError:
            server.close(f"killed: no answer to initialize within timeout_s = {self.config.timeout_s:g} s")
            raise ToolError(
                "timeout",
                f"timed out after {self.config.timeout_s:g} s while the {self.config.name} MCP server "
                f"started{self._restart_note()}",
            ) from None
        except ServerGone as e:
            server.close()
            raise ToolError(
                "mcp_server_died",
                f"the {self.config.name} MCP server did not start ({e}){self._restart_note()}",
            ) from None
        return server

    def _exchange(self, server: ServerProcess, request: dict[str, Any], deadline: float) -> dict[str, Any]:
        """Send ``request`` and return the answer with its id; the server's own requests (``ping``,
        ``roots/list``, ...) get a JSON-RPC error, its notifications are skipped."""
        server.send(json.dumps(request).encode() + b"\n", deadline)
        while True:
            line = server.receive(deadline)
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if not isinstance(message, dict):
                continue
            if "method" in message and "id" in message:
                refusal = {
                    "jsonrpc": "2.0",
                    "id": message["id"],
                    "error": {"code": -32601, "message": "this client serves no requests"},
                }
                server.send(json.dumps(refusal).encode() + b"\n", deadline)
            elif message.get("id") == request["id"] and ("result" in message or "error" in message):
                return message

    def _restart_note(self) -> str:
        left = self.config.max_restarts + 1 - self.num_starts
        if left <= 0:
            return f"; it is not started again in this episode (max_restarts = {self.config.max_restarts})"
        return f"; the next call starts it again ({left} restart{'s' if left != 1 else ''} left)"


class _PerCallClient(_Client):
    """One sandbox run per request (``lifetime = "call"``, see the module docstring)."""

    def __init__(self, config: McpServerConfig, sandbox: Sandbox, workspace: Workspace) -> None:
        self.config, self.sandbox, self.workspace = config, sandbox, workspace
        self.limits = sandbox.config.limits.model_copy(update={"timeout_s": config.timeout_s})

    def list_tools(self) -> list[dict[str, Any]]:
        key = json.dumps(self.config.command)
        with _listed_lock:
            if key in _listed:
                return _listed[key]
        result, run = self._request("tools/list", {})
        tools = _tool_list(self.config.name, result, _describe(run))
        with _listed_lock:
            _listed[key] = tools
        return tools

    def call_tool(self, name: str, arguments: dict[str, Any]) -> tuple[str, RunResult | None]:
        result, run = self._request("tools/call", {"name": name, "arguments": arguments})
        if run.timed_out or run.killed_by is not None:
            return format_run(run, self.config.timeout_s), run
        if result is None:
            raise ToolError("mcp_error", f"the {self.config.name} MCP server failed: {_describe(run)}")
        return _render(self.config.name, result), run

    def _request(self, method: str, params: dict[str, Any]) -> tuple[dict[str, Any] | None, RunResult]:
        """The ``result`` of one request (None when there is none) and the run that made it."""
        assert self.config.command is not None
        messages = [
            _initialize(),
            _INITIALIZED,
            {"jsonrpc": "2.0", "id": 1, "method": method, "params": params},
        ]
        stdin = "".join(json.dumps(m) + "\n" for m in messages).encode()
        run = self.sandbox.run(
            self.workspace, ["python", "-c", _RELAY, *self.config.command], limits=self.limits, stdin=stdin
        )
        for line in run.stdout.splitlines():
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if not isinstance(message, dict) or message.get("id") != 1:
                continue
            if isinstance(message.get("error"), dict):
                raise _refused(self.config.name, message)
            result = message.get("result")
            return (result if isinstance(result, dict) else None), run
        return None, run


class _HttpClient(_Client):
    """A session per call with the ``mcp`` SDK's streamable-HTTP client."""

    def __init__(self, config: McpServerConfig) -> None:
        self.config = config

    def list_tools(self) -> list[dict[str, Any]]:
        try:
            result = self._run(self._list())
        except Exception as e:
            raise McpError(
                f"mcp server {self.config.name!r} at {self.config.url}: tools/list failed: {e}"
            ) from e
        return [tool.model_dump(mode="json", exclude_none=True, by_alias=True) for tool in result.tools]

    def call_tool(self, name: str, arguments: dict[str, Any]) -> tuple[str, RunResult | None]:
        try:
            result = self._run(self._call(name, arguments))
        except TimeoutError as e:
            raise ToolError(
                "timeout", f"the {self.config.name} MCP server did not answer in {self.config.timeout_s:g} s"
            ) from e
        except Exception as e:
            raise ToolError(
                "mcp_error", f"the {self.config.name} MCP server failed ({type(e).__name__}: {e})"
            ) from e
        return _render(
            self.config.name, result.model_dump(mode="json", exclude_none=True, by_alias=True)
        ), None

    def _run(self, coroutine: Any) -> Any:
        """Run on a loop of this thread's own (tools run on the sandbox's worker threads)."""

        async def bounded() -> Any:
            return await asyncio.wait_for(coroutine, self.config.timeout_s)

        return asyncio.run(bounded())

    async def _list(self) -> ListToolsResult:
        async with self._session() as client:
            return await client.list_tools()

    async def _call(self, name: str, arguments: dict[str, Any]) -> CallToolResult:
        async with self._session() as client:
            return await client.call_tool(name, arguments)

    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[Any]:
        """An SDK client session; with ``headers_env`` its HTTP client sends those headers."""
        from mcp import Client
        from mcp.client.streamable_http import create_mcp_http_client, streamable_http_client

        url = self.config.url or ""
        if not self.config.headers_env:
            async with Client(url) as client:
                yield client
            return
        async with (
            create_mcp_http_client(headers=self.headers()) as http,
            Client(streamable_http_client(url, http_client=http)) as client,
        ):
            yield client

    def headers(self) -> dict[str, str]:
        """``headers_env``'s headers with their values read from the environment now."""
        missing = [v for v in self.config.headers_env.values() if not os.environ.get(v)]
        if missing:
            raise McpError(
                f"mcp server {self.config.name!r}: headers_env reads {', '.join(sorted(missing))}, which "
                "is not set (or empty) in the orchestrator's environment; export it before the run"
            )
        return {header: os.environ[v] for header, v in self.config.headers_env.items()}


def _render(server: str, result: dict[str, Any]) -> str:
    """The model's view of a ``tools/call`` result; ``isError`` raises it as a ``ToolError``."""
    try:
        parsed = CallToolResult.model_validate(result)
    except ValidationError as e:
        raise ToolError(
            "mcp_error", f"the {server} MCP server sent an invalid result ({e.error_count()} errors)"
        ) from e
    parts: list[str] = []
    for block in parsed.content:
        text = getattr(block, "text", None)
        parts.append(text if isinstance(text, str) else f"[{block.type} content not shown]")
    if not parts and parsed.structured_content is not None:
        parts.append(json.dumps(parsed.structured_content))
    text = "\n".join(parts) or "(no output)"
    if parsed.is_error:
        raise ToolError("mcp_tool_error", text)
    return text


def _describe(run: RunResult) -> str:
    if run.timed_out:
        return "timed out"
    stderr = run.stderr.strip().splitlines()
    return f"exit code {run.exit_code}" + (f": {stderr[-1]}" if stderr else "")

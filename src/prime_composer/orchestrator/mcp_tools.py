"""MCP tool servers as agent tools: their tools become ``Tool``s of the episode's ``Toolset``.

An agent task (``AgentTaskData.mcp_servers``) or the agent loop (``AgentLoopConfig.mcp_servers``)
lists servers; ``mcp_tools`` asks each for its tools (``tools/list``) and wraps every tool as a
``prime_composer.sandbox.Tool``, so an MCP tool is rendered, parsed, argument-checked, capped,
timed, locked and recorded exactly like ``read_file`` (``sandbox/tools.py``). A tool's failure
(``isError``, a JSON-RPC error, a server that crashed or timed out) is a tool result the model
sees, never an exception out of the episode.

Two transports:

- **stdio** (``command``): the server runs *in the episode's sandbox*, in its workspace, as the
  workspace's user, without network. The sandbox runs a command to completion (``Sandbox.run``),
  and the file tools are safe only because no sandboxed process outlives its run
  (``sandbox/files.py``), so a server is not kept running across calls: each call is one sandbox
  run of a small relay (``_RELAY``, stdlib only) that starts the server, sends ``initialize``,
  ``notifications/initialized`` and the request, waits for the answer and then closes the
  server's stdin. (Closing stdin right after the request is not enough: the SDK's servers cancel
  requests still in flight at end of input.) What a server keeps between calls must therefore
  live in the workspace's files. The cost is one server start-up per call (``bench/`` numbers in
  ``docs/experiments.md``). The tool list of a command is asked once per process.
- **streamable HTTP** (``url``): a server that is already running; each call opens a session with
  the ``mcp`` SDK's client from the orchestrator's process (not sandboxed).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Sequence
from typing import Any

from mcp_types import CallToolResult, ListToolsResult
from pydantic import ValidationError

from prime_composer.config.env import McpServerConfig
from prime_composer.sandbox import RunResult, Sandbox, Workspace, format_run
from prime_composer.sandbox.files import ToolError
from prime_composer.sandbox.tools import Tool

PROTOCOL_VERSION = "2025-06-18"
"""The MCP protocol version this client speaks (the handshake protocol; servers of the 2.x SDK
and older ones accept it)."""

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
        client: _Client = (
            _StdioClient(server, sandbox, workspace) if server.command is not None else _HttpClient(server)
        )
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


class _StdioClient(_Client):
    """One sandbox run per request (see the module docstring)."""

    def __init__(self, config: McpServerConfig, sandbox: Sandbox, workspace: Workspace) -> None:
        self.config, self.sandbox, self.workspace = config, sandbox, workspace
        self.limits = sandbox.config.limits.model_copy(update={"timeout_s": config.timeout_s})

    def list_tools(self) -> list[dict[str, Any]]:
        key = json.dumps(self.config.command)
        with _listed_lock:
            if key in _listed:
                return _listed[key]
        result, run = self._request("tools/list", {})
        if result is None:
            raise McpError(f"mcp server {self.config.name!r}: tools/list failed: {_describe(run)}")
        try:
            tools = [
                tool.model_dump(mode="json", exclude_none=True, by_alias=True)
                for tool in ListToolsResult.model_validate(result).tools
            ]
        except ValidationError as e:
            raise McpError(f"mcp server {self.config.name!r}: tools/list sent an invalid answer: {e}") from e
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
            {
                "jsonrpc": "2.0",
                "id": 0,
                "method": "initialize",
                "params": {
                    "protocolVersion": PROTOCOL_VERSION,
                    "capabilities": {},
                    "clientInfo": CLIENT_INFO,
                },
            },
            {"jsonrpc": "2.0", "method": "notifications/initialized"},
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
                error = message["error"]
                raise ToolError(
                    "mcp_error", f"the {self.config.name} MCP server refused the call: {error.get('message')}"
                )
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
        from mcp import Client

        async with Client(self.config.url or "") as client:
            return await client.list_tools()

    async def _call(self, name: str, arguments: dict[str, Any]) -> CallToolResult:
        from mcp import Client

        async with Client(self.config.url or "") as client:
            return await client.call_tool(name, arguments)


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

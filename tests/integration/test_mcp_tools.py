"""MCP tool servers as agent tools: a small ``mcp`` SDK server (``mcp_calc_server.py``) over stdio
in the real sandbox and over streamable HTTP on loopback, its tools in a ``Toolset`` beside the
sandbox's, and a scripted agent episode that calls one and sees its answer in the next prompt.

Each stdio call is a sandbox run that starts the server (``orchestrator/mcp_tools.py``), about
3 s of CPU for the SDK's imports, so the module keeps the number of calls small."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from prime_composer.config.env import AgentLoopConfig, McpServerConfig
from prime_composer.config.ports import free_port
from prime_composer.config.sandbox import SandboxConfig, ToolsConfig
from prime_composer.model.resolve import resolve_model_name
from prime_composer.orchestrator.chat_render import ChatRenderer
from prime_composer.orchestrator.episode import Generation, run_episode
from prime_composer.orchestrator.mcp_tools import McpError, mcp_tools
from prime_composer.sandbox import Sandbox, Toolset, Workspace
from prime_composer.tool_calls import get_parser

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="isolated runs need root")

SERVER = Path(__file__).with_name("mcp_calc_server.py")
STDIO = McpServerConfig(name="calc", command=["python", "mcp_server.py"], timeout_s=180)


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    with Sandbox(SandboxConfig()) as sandbox:
        yield sandbox


@pytest.fixture(scope="module")
def workspace(sandbox: Sandbox, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workspace]:
    task = tmp_path_factory.mktemp("task")
    (task / "mcp_server.py").write_text(SERVER.read_text())
    with sandbox.workspace(task) as workspace:
        yield workspace


@pytest.fixture(scope="module")
def toolset(sandbox: Sandbox, workspace: Workspace) -> Toolset:
    extra = mcp_tools([STDIO], sandbox, workspace)
    config = ToolsConfig(enabled=["read_file", "run"])
    return Toolset(sandbox, workspace, config, extra_tools=extra)


def call(tools: Toolset, name: str, **arguments: Any) -> Any:
    return tools.call(name, json.dumps(arguments))


def test_stdio_server_tools_sit_beside_the_sandbox_tools(toolset: Toolset) -> None:
    names = [d["function"]["name"] for d in toolset.definitions()]
    assert names == ["read_file", "run", "add", "append_note", "fail", "nap"]
    add = toolset.definitions()[2]["function"]
    assert add["description"] == "Add two integers."
    assert add["parameters"]["required"] == ["a", "b"]
    assert add["parameters"]["properties"]["a"]["type"] == "integer"


def test_stdio_calls_run_in_the_sandbox_on_the_episode_workspace(toolset: Toolset) -> None:
    result = call(toolset, "add", a=2, b=40)
    assert result.content == "42" and result.record.ok and result.record.run["exit_code"] == 0
    # The server ran as the workspace's user in its folder: its file is the episode's file.
    note = call(toolset, "append_note", text="from mcp")
    assert note.content == "from mcp\n"
    assert call(toolset, "read_file", path="notes.txt").content.endswith("from mcp")
    assert (
        call(toolset, "run", command="id -u; stat -c %u notes.txt").content.split()[-2:]
        == [str(toolset.workspace.uid)] * 2
    )
    # A tool that fails is a result the model sees, recorded as such.
    failed = call(toolset, "fail", reason="no such thing")
    # (The SDK's server hides the exception's text from the client.)
    assert failed.content == "Error: Error executing tool fail"
    assert failed.record.error == "mcp_tool_error" and not failed.record.ok


def test_bad_arguments_are_refused_before_the_server_runs(toolset: Toolset) -> None:
    missing = call(toolset, "add", a=1)
    assert missing.content == "Error: add needs the argument 'b'" and missing.record.run is None
    wrong = call(toolset, "add", a=1, b="two")
    assert wrong.record.error == "invalid_arguments" and "must be of type integer" in wrong.content
    assert call(toolset, "mul", a=1).record.error == "unknown_tool"


def test_a_server_that_outlives_its_timeout_is_killed(sandbox: Sandbox, workspace: Workspace) -> None:
    mcp_tools([STDIO], sandbox, workspace)  # a command's tool list is asked once per process
    quick = STDIO.model_copy(update={"timeout_s": 0.5, "tools": ["nap"]})
    toolset = Toolset(
        sandbox, workspace, ToolsConfig(enabled=[]), extra_tools=mcp_tools([quick], sandbox, workspace)
    )
    result = call(toolset, "nap", seconds=60)
    assert result.record.error == "timeout" and result.content.startswith("Error: timed out after 0.5 s")
    assert result.record.duration_s < 10


def test_same_names_and_missing_tools_are_errors(sandbox: Sandbox, workspace: Workspace) -> None:
    extra = mcp_tools([STDIO], sandbox, workspace)
    clash = type(extra[0])("run", "x", {"type": "object"}, extra[0].handler, external=True)
    with pytest.raises(ValueError, match="two tools are named 'run'"):
        Toolset(sandbox, workspace, ToolsConfig(enabled=["run"]), extra_tools=[clash])
    with pytest.raises(McpError, match="has no tool 'mul'"):
        mcp_tools([STDIO.model_copy(update={"tools": ["add", "mul"]})], sandbox, workspace)
    with pytest.raises(ValueError, match="exactly one of command"):
        McpServerConfig(name="x")


class Script:
    """A policy that writes ``replies`` in order, as the tiny model's tokens."""

    def __init__(self, tok: Any, replies: list[str]) -> None:
        self.tok, self.replies = tok, replies
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_ids: list[int], max_tokens: int, turn: int) -> Generation:
        self.prompts.append(list(prompt_ids))
        ids = [*self.tok.encode(self.replies[turn], add_special_tokens=False), self.tok.eos_token_id]
        return Generation(ids, [-0.5] * len(ids), "stop")


def test_an_agent_episode_calls_an_mcp_tool_and_sees_its_result(toolset: Toolset) -> None:
    tok = AutoTokenizer.from_pretrained(resolve_model_name("builtin:tiny-qwen3"))
    replies = ['<tool_call>{"name": "add", "arguments": {"a": 20, "b": 22}}</tool_call>', "It is 42."]
    messages = [{"role": "user", "content": "What is 20 + 22? Use the add tool."}]
    script = Script(tok, replies)
    episode = asyncio.run(
        run_episode(
            script,
            ChatRenderer(tok),
            get_parser("hermes"),
            messages,
            toolset,
            AgentLoopConfig(),
            max_reply_tokens=100,
            max_context_tokens=None,
        )
    )
    assert episode.stop == "final_answer" and len(episode.turns) == 2
    result = episode.turns[0].tool_results[0]
    assert (result.name, result.content, result.ok, result.exit_code) == ("add", "42", True, 0)
    # The second prompt is the template's rendering of the conversation with the MCP tool's
    # definition and its answer: what the model saw, token for token.
    expected = tok.apply_chat_template(
        episode.messages[:3], tools=toolset.definitions(), tokenize=False, add_generation_prompt=True
    )
    assert script.prompts[1] == tok.encode(expected, add_special_tokens=False)
    assert episode.messages[2] == {
        "role": "tool",
        "name": "add",
        "content": "42",
        "tool_call_id": result.call_id,
    }
    assert '"name": "add"' in expected


@pytest.fixture(scope="module")
def http_url() -> Iterator[str]:
    port = free_port()
    server = subprocess.Popen([sys.executable, str(SERVER), "--http", str(port)], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.TransportError:
                assert server.poll() is None, "the HTTP MCP server exited"
                time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(10)


def test_streamable_http_server_tools(http_url: str, sandbox: Sandbox, workspace: Workspace) -> None:
    server = McpServerConfig(name="remote", url=http_url, tools=["add", "fail"], timeout_s=60)
    toolset = Toolset(
        sandbox, workspace, ToolsConfig(enabled=[]), extra_tools=mcp_tools([server], sandbox, workspace)
    )
    assert [d["function"]["name"] for d in toolset.definitions()] == ["add", "fail"]
    result = call(toolset, "add", a=-3, b=10)
    assert result.content == "7" and result.record.ok and result.record.run is None
    failed = call(toolset, "fail", reason="over http")
    assert failed.record.error == "mcp_tool_error" and failed.content == "Error: Error executing tool fail"
    gone = McpServerConfig(name="gone", url=f"http://127.0.0.1:{free_port()}/mcp", timeout_s=5)
    with pytest.raises(McpError, match="gone"):
        mcp_tools([gone], sandbox, workspace)

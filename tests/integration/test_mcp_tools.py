"""MCP tool servers as agent tools: a small ``mcp`` SDK server (``mcp_calc_server.py``) over stdio
in the real sandbox and over streamable HTTP on loopback, its tools in a ``Toolset`` beside the
sandbox's, and a scripted agent episode that calls one and sees its answer in the next prompt.

A stdio server lives for the episode (``lifetime = "episode"``, paused between its calls) or
starts for each call (``"call"``); each start costs about 3 s of CPU for the SDK's imports
(``orchestrator/mcp_tools.py``), so the module keeps the number of starts small."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
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
from prime_composer.orchestrator.agent_task import AgentTaskData
from prime_composer.orchestrator.chat_render import ChatRenderer
from prime_composer.orchestrator.episode import Generation, run_episode
from prime_composer.orchestrator.mcp_tools import McpError, mcp_tools
from prime_composer.orchestrator.rollout import _agent_metrics
from prime_composer.sandbox import Sandbox, Toolset, Workspace
from prime_composer.sandbox.server import _processes_of
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
    assert names == ["read_file", "run", "add", "append_note", "fail", "nap", "count", "crash", "limits"]
    add = toolset.definitions()[2]["function"]
    assert add["description"] == "Add two integers."
    assert add["parameters"]["required"] == ["a", "b"]
    assert add["parameters"]["properties"]["a"]["type"] == "integer"


def test_stdio_calls_run_in_the_sandbox_on_the_episode_workspace(toolset: Toolset) -> None:
    result = call(toolset, "add", a=2, b=40)
    assert result.content == "42" and result.record.ok and result.record.run is None
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


def uid_processes(uid: int | None) -> list[tuple[int, str]]:
    """(pid, state) of every process of ``uid`` on the machine (read from ``/proc``, not the code's cgroup)."""
    assert uid is not None
    states = []
    for entry in os.scandir("/proc"):
        try:
            text = Path(entry.path, "status").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
        if fields.get("Uid", "").split()[:1] == [str(uid)]:
            states.append((int(entry.name), fields["State"][0]))
    return states


def test_one_server_process_serves_the_episode_and_is_stopped_between_calls(toolset: Toolset) -> None:
    """The server keeps its memory across calls (its counter goes on), runs as the workspace's
    user under the sandbox's limits, and between calls every process of that user is stopped
    (SIGSTOP), so the file tools and ``run`` work with nothing sandboxed running beside them."""
    first = int(call(toolset, "count").content)
    assert call(toolset, "count").content == str(first + 1)
    processes = uid_processes(toolset.workspace.uid)
    assert processes and all(state == "T" for _, state in processes), processes
    assert call(toolset, "run", command="echo between").content.endswith("between")
    assert uid_processes(toolset.workspace.uid) == processes  # the same process, still stopped
    seen = json.loads(call(toolset, "limits").content)
    assert seen == {"uid": toolset.workspace.uid, "nofile": toolset.sandbox.config.limits.max_open_files}
    assert call(toolset, "count").content == str(first + 2)
    # The module's own reader agrees with the independent one above.
    assert sorted(_processes_of(toolset.workspace.uid, [str(pid) for pid, _ in processes])) == processes


def test_lifetime_call_starts_the_server_for_each_call(sandbox: Sandbox, workspace: Workspace) -> None:
    per_call = STDIO.model_copy(update={"lifetime": "call", "tools": ["count"]})
    toolset = Toolset(
        sandbox, workspace, ToolsConfig(enabled=[]), extra_tools=mcp_tools([per_call], sandbox, workspace)
    )
    for _ in range(2):
        result = call(toolset, "count")
        assert result.content == "1" and result.record.run["exit_code"] == 0


@pytest.mark.slow
def test_a_server_that_dies_or_times_out_is_a_tool_error_and_restarts_at_most_max_restarts_times(
    sandbox: Sandbox, tmp_path: Path
) -> None:
    (tmp_path / "mcp_server.py").write_text(SERVER.read_text())
    # timeout_s leaves room for each start-up (~1.5 s of CPU from bytecode, 3-4 of them here), not for
    # a 10-minute nap.
    server = STDIO.model_copy(update={"max_restarts": 2, "timeout_s": 15, "tools": ["count", "crash", "nap"]})
    with sandbox.workspace(tmp_path) as workspace:
        toolset = Toolset(
            sandbox, workspace, ToolsConfig(enabled=[]), extra_tools=mcp_tools([server], sandbox, workspace)
        )
        assert call(toolset, "count").content == "1"
        slow = call(toolset, "nap", seconds=600)
        assert slow.record.error == "timeout" and 15 <= slow.record.duration_s < 45
        assert slow.content.startswith("Error: timed out after 15 s; the calc MCP server was stopped")
        assert "2 restarts left" in slow.content and uid_processes(workspace.uid) == []
        assert call(toolset, "count").content == "1"  # a new process
        died = call(toolset, "crash", code=3)
        assert died.record.error == "mcp_server_died" and not died.record.ok
        assert "ended (exit code 3)" in died.content and "1 restart left" in died.content, died.content
        assert uid_processes(workspace.uid) == []
        assert call(toolset, "count").content == "1"  # a new process
        died = call(toolset, "crash", code=4)
        assert "exit code 4" in died.content and "not started again" in died.content
        refused = call(toolset, "count")
        assert refused.record.error == "mcp_server_died" and "ended 3 times" in refused.content


def test_concurrent_episodes_have_their_own_servers_stopped_with_the_episode(
    sandbox: Sandbox, tmp_path: Path
) -> None:
    (tmp_path / "mcp_server.py").write_text(SERVER.read_text())
    server = STDIO.model_copy(update={"tools": ["count"]})
    first, second = sandbox.workspace(tmp_path), sandbox.workspace(tmp_path)
    try:
        toolsets = [
            Toolset(sandbox, w, ToolsConfig(enabled=[]), extra_tools=mcp_tools([server], sandbox, w))
            for w in (first, second)
        ]
        answers: list[str] = ["", ""]

        def count(i: int) -> None:
            answers[i] = call(toolsets[i], "count").content

        threads = [threading.Thread(target=count, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert answers == ["1", "1"]
        assert call(toolsets[0], "count").content == "2"
        assert uid_processes(first.uid) and uid_processes(second.uid)
        first.close()  # the episode ends: its server is killed before its uid is freed
        assert uid_processes(first.uid) == []
        assert call(toolsets[1], "count").content == "2"
    finally:
        first.close()
        second.close()
    assert uid_processes(second.uid) == []


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
    assert uid_processes(workspace.uid) == [] or all(s == "T" for _, s in uid_processes(workspace.uid))


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
    assert (result.name, result.content, result.ok, result.exit_code) == ("add", "42", True, None)
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
    metrics = _agent_metrics(episode)
    assert (metrics["agent/mcp_calls"], metrics["agent/mcp_errors"]) == (1.0, 0.0)
    assert metrics["agent/mcp_call_s"] == result.duration_s > 0


def test_the_agent_metrics_count_mcp_calls_apart(toolset: Toolset) -> None:
    """One reply calls a sandbox tool and an MCP tool with an argument missing (refused before any
    server runs, so no start-up is paid): two calls, one of them MCP's, and its failure."""
    tok = AutoTokenizer.from_pretrained(resolve_model_name("builtin:tiny-qwen3"))
    replies = [
        '<tool_call>{"name": "read_file", "arguments": {"path": "mcp_server.py"}}</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',
        "Done.",
    ]
    episode = asyncio.run(
        run_episode(
            Script(tok, replies),
            ChatRenderer(tok),
            get_parser("hermes"),
            [{"role": "user", "content": "Read the server, then add."}],
            toolset,
            AgentLoopConfig(),
            max_reply_tokens=100,
            max_context_tokens=None,
        )
    )
    read, add = episode.turns[0].tool_results
    assert (read.name, read.ok, read.external) == ("read_file", True, False)
    assert (add.name, add.error, add.external) == ("add", "invalid_arguments", True)
    metrics = _agent_metrics(episode)
    assert metrics["agent/num_tool_calls"] == 2.0 and metrics["agent/tool_errors"] == 1.0
    assert (metrics["agent/mcp_calls"], metrics["agent/mcp_errors"]) == (1.0, 1.0)
    assert metrics["agent/mcp_call_s"] == add.duration_s


@pytest.fixture(scope="module")
def http_url() -> Iterator[str]:
    yield from _serve_http([])


TOKEN = "t0k3n-" + os.urandom(8).hex()


@pytest.fixture(scope="module")
def auth_url() -> Iterator[str]:
    """The server behind ``Authorization: Bearer TOKEN`` (given to it in its own environment)."""
    yield from _serve_http(["--token-env", "PC_TEST_SERVER_TOKEN"], {"PC_TEST_SERVER_TOKEN": TOKEN})


def _serve_http(args: list[str], env: dict[str, str] | None = None) -> Iterator[str]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, str(SERVER), "--http", str(port), *args],
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
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


def test_headers_env_sends_headers_from_the_environment(
    auth_url: str, sandbox: Sandbox, workspace: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that wants a bearer token: refused without it or with a wrong one, served with
    the one read from the variable ``headers_env`` names; the value is in no error or config."""
    server = McpServerConfig(
        name="private",
        url=auth_url,
        tools=["add"],
        timeout_s=60,
        headers_env={"Authorization": "PC_MCP_AUTH"},
    )
    monkeypatch.delenv("PC_MCP_AUTH", raising=False)
    with pytest.raises(McpError, match="headers_env reads PC_MCP_AUTH, which is not set"):
        mcp_tools([server], sandbox, workspace)
    with pytest.raises(McpError, match=r"private.*tools/list failed"):
        mcp_tools([server.model_copy(update={"headers_env": {}})], sandbox, workspace)
    monkeypatch.setenv("PC_MCP_AUTH", "Bearer wrong-" + TOKEN[::-1])
    with pytest.raises(McpError) as refused:
        mcp_tools([server], sandbox, workspace)
    assert TOKEN[::-1] not in str(refused.value)
    monkeypatch.setenv("PC_MCP_AUTH", f"Bearer {TOKEN}")
    toolset = Toolset(
        sandbox, workspace, ToolsConfig(enabled=[]), extra_tools=mcp_tools([server], sandbox, workspace)
    )
    result = call(toolset, "add", a=2, b=3)
    assert result.content == "5" and result.record.ok
    assert TOKEN not in json.dumps(server.model_dump()) and TOKEN not in json.dumps(result.record.to_dict())


def test_headers_env_config_errors() -> None:
    with pytest.raises(ValueError, match="headers_env is for a url server"):
        McpServerConfig(name="s", command=["python", "s.py"], headers_env={"Authorization": "X"})
    with pytest.raises(ValueError, match="plain http to a host that is not loopback"):
        McpServerConfig(name="s", url="http://10.1.2.3:80/mcp", headers_env={"Authorization": "X"})
    with pytest.raises(ValueError, match="give the name of an environment variable"):
        McpServerConfig(name="s", url="https://mcp.example/mcp", headers_env={"Authorization": "Bearer abc"})
    with pytest.raises(ValueError, match="not an HTTP header name"):
        McpServerConfig(name="s", url="https://mcp.example/mcp", headers_env={"Bad Header": "X"})
    ok = McpServerConfig(name="s", url="https://mcp.example/mcp", headers_env={"Authorization": "MY_TOKEN"})
    assert ok.headers_env == {"Authorization": "MY_TOKEN"}
    # Task data cannot pick environment variables to send: only the config's servers may.
    with pytest.raises(ValueError, match="headers_env is refused in task data"):
        AgentTaskData(id="t", prompt="p", mcp_servers=[ok])
    assert AgentTaskData(id="t", prompt="p", mcp_servers=[ok.model_copy(update={"headers_env": {}})])

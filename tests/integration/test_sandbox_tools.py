"""The coding tools on a real sandbox: a scripted fix-the-bug episode, search, and the checks that
depend on the workspace's uid (hard links out, ownership of what the tools create)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from prime_composer.config.sandbox import SandboxConfig, ToolsConfig
from prime_composer.sandbox import Sandbox, Toolset, Workspace

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="isolated runs need root")

TEST_COMMAND = ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider"]


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    with Sandbox(SandboxConfig()) as sandbox:
        yield sandbox


@pytest.fixture
def task(tmp_path: Path) -> Path:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "calc.py").write_text(
        "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
    )
    (tmp_path / "test_calc.py").write_text(
        "from pkg.calc import add, mul\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
        "def test_mul():\n    assert mul(2, 3) == 6\n"
    )
    return tmp_path


@pytest.fixture
def workspace(sandbox: Sandbox, task: Path) -> Iterator[Workspace]:
    with sandbox.workspace(task) as workspace:
        yield workspace


def call(tools: Toolset, name: str, **arguments: object) -> str:
    return tools.call(name, json.dumps(arguments)).content


def test_a_scripted_episode_fixes_the_bug(sandbox: Sandbox, workspace: Workspace) -> None:
    tools = Toolset(sandbox, workspace, test_command=TEST_COMMAND)
    assert call(tools, "list_files") == "pkg/\npkg/__init__.py\npkg/calc.py\ntest_calc.py"
    assert call(tools, "search", pattern=r"return a \W b", glob="*.py") == (
        "pkg/calc.py:2:    return a - b\npkg/calc.py:6:    return a * b"
    )
    failing = call(tools, "run_tests")
    assert failing.startswith("Exit code: 1") and "1 failed, 1 passed" in failing
    assert (
        call(tools, "read_file", path="pkg/calc.py", start_line=1, end_line=2)
        == "1\tdef add(a, b):\n2\t    return a - b"
    )
    assert call(tools, "edit_file", path="pkg/calc.py", old_string="a - b", new_string="a + b").startswith(
        "Edited"
    )
    passing = call(tools, "run_tests")
    assert passing.startswith("Exit code: 0") and "2 passed" in passing
    assert [r.name for r in tools.records] == [
        "list_files",
        "search",
        "run_tests",
        "read_file",
        "edit_file",
        "run_tests",
    ]
    assert all(r.ok for r in tools.records)
    assert tools.records[2].run is not None and tools.records[2].run["exit_code"] == 1


def test_search_reports_no_matches_and_bad_patterns(sandbox: Sandbox, workspace: Workspace) -> None:
    tools = Toolset(sandbox, workspace, test_command=TEST_COMMAND)
    assert call(tools, "search", pattern="no_such_name") == "No matches."
    bad = tools.call("search", json.dumps({"pattern": "(unclosed"}))
    assert bad.content.startswith("Error: search failed") and bad.record.error == "invalid_arguments"
    outside = tools.call("search", json.dumps({"pattern": "root", "path": "/etc"}))
    assert outside.record.error == "path_outside_workspace"
    capped = Toolset(sandbox, workspace, ToolsConfig(max_search_matches=1), test_command=TEST_COMMAND)
    lines = call(capped, "search", pattern="def").splitlines()
    assert len(lines) == 2 and lines[1].startswith("[... more matches not shown (limit 1)")


def test_files_the_tools_create_belong_to_the_workspace_user(sandbox: Sandbox, workspace: Workspace) -> None:
    tools = Toolset(sandbox, workspace, test_command=TEST_COMMAND)
    call(tools, "write_file", path="new/dir/notes.txt", content="one\n")
    for path in ("new", "new/dir", "new/dir/notes.txt"):
        assert (workspace.path / path).stat().st_uid == workspace.uid
    appended = call(tools, "run", command="echo two >> new/dir/notes.txt && cat new/dir/notes.txt")
    assert appended == "Exit code: 0\nstdout:\none\ntwo"


def test_hard_links_to_files_outside_are_refused(sandbox: Sandbox, workspace: Workspace) -> None:
    # A hard link to a file outside the workspace on the same file system, as a sandboxed process
    # could make it where fs.protected_hardlinks is 0; the tools run as root and must not touch it.
    # (The workspace's folder is its own tmpfs, so the file must lie in it, beside work/.)
    outside = workspace.root / f"outside-{workspace.uid}.txt"
    outside.write_text("root's file\n")
    try:
        os.link(outside, workspace.path / "link.txt")
        tools = Toolset(sandbox, workspace, test_command=TEST_COMMAND)
        for name, arguments in [
            ("read_file", {"path": "link.txt"}),
            ("write_file", {"path": "link.txt", "content": "pwned"}),
            ("edit_file", {"path": "link.txt", "old_string": "root", "new_string": "pwned"}),
        ]:
            result = tools.call(name, json.dumps(arguments))
            assert result.record.error == "path_outside_workspace", (name, result.content)
        assert outside.read_text() == "root's file\n"
    finally:
        outside.unlink()


def test_run_output_is_truncated_for_the_model(sandbox: Sandbox, workspace: Workspace) -> None:
    tools = Toolset(sandbox, workspace, ToolsConfig(max_result_bytes=2000), test_command=TEST_COMMAND)
    result = tools.call("run", json.dumps({"command": "seq 1 10000"}))
    assert result.record.ok and result.record.truncated
    assert result.content.startswith("Exit code: 0\nstdout:\n1\n2\n3\n")
    assert result.content.endswith("9999\n10000")
    assert "bytes cut: output is limited to" in result.content
    assert len(result.content.encode()) < 2000 + 100


def test_definitions_follow_the_enabled_tools(sandbox: Sandbox, workspace: Workspace) -> None:
    tools = Toolset(sandbox, workspace, ToolsConfig(enabled=["read_file", "run"]))
    definitions = tools.definitions()
    assert [d["function"]["name"] for d in definitions] == ["read_file", "run"]
    for definition in definitions:
        assert definition["type"] == "function"
        schema = definition["function"]["parameters"]
        assert schema["type"] == "object" and set(schema["required"]) <= set(schema["properties"])
        json.dumps(definition)
    hidden = tools.call("write_file", json.dumps({"path": "x", "content": "y"}))
    assert hidden.record.error == "unknown_tool" and "read_file, run" in hidden.content
    with pytest.raises(ValueError, match="no test command"):
        Toolset(sandbox, workspace, ToolsConfig(enabled=["run_tests"]))


def test_concurrent_calls_from_many_episodes(sandbox: Sandbox, task: Path) -> None:
    async def episode(index: int) -> str:
        with sandbox.workspace(task) as workspace:
            tools = Toolset(sandbox, workspace, test_command=TEST_COMMAND)
            await tools.call_async("write_file", json.dumps({"path": "id.txt", "content": f"{index}\n"}))
            result = await tools.call_async("run", json.dumps({"command": "cat id.txt; id -u"}))
            return result.content

    async def main() -> list[str]:
        return await asyncio.gather(*(episode(i) for i in range(16)))

    outputs = asyncio.run(main())
    uids = set()
    for index, output in enumerate(outputs):
        lines = output.splitlines()
        assert lines[:3] == ["Exit code: 0", "stdout:", str(index)]
        uids.add(lines[3])
    assert len(uids) == 16


def test_calls_of_one_episode_never_overlap(sandbox: Sandbox, workspace: Workspace) -> None:
    # Several tool calls of one reply, run concurrently by a harness, still take turns: the file
    # tools must never run while a sandboxed process of the same workspace is alive.
    tools = Toolset(sandbox, workspace, test_command=TEST_COMMAND)
    command = json.dumps({"command": "date +%s.%N; sleep 0.5; date +%s.%N"})

    async def main() -> list[str]:
        return [
            r.content for r in await asyncio.gather(*(tools.call_async("run", command) for _ in range(3)))
        ]

    spans = sorted(tuple(map(float, content.splitlines()[2:4])) for content in asyncio.run(main()))
    for (_, end), (next_start, _) in itertools.pairwise(spans):
        assert next_start >= end

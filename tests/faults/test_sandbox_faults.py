"""Faults in tool calls and in the sandbox itself become tool results and records, never a crash
of the episode; a dead parent leaves no sandboxed process behind; a machine that cannot isolate
refuses to run unless told otherwise, and then says so loudly."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from prime_composer.config.sandbox import LimitsConfig, SandboxConfig
from prime_composer.sandbox import IsolationUnavailable, Sandbox, SandboxError, Toolset, Workspace
from prime_composer.sandbox import files as file_tools

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="isolated runs need root")

LIMITS = LimitsConfig(timeout_s=1.0, max_output_bytes=1000, kill_output_bytes=100_000)


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    with Sandbox(SandboxConfig(limits=LIMITS, allow_unisolated=os.geteuid() != 0)) as sandbox:
        yield sandbox


@pytest.fixture
def workspace(sandbox: Sandbox) -> Iterator[Workspace]:
    with sandbox.workspace() as workspace:
        (workspace.path / "a.txt").write_text("alpha\n")
        workspace.give(workspace.path / "a.txt")
        yield workspace


def test_every_bad_call_is_a_result_and_the_episode_goes_on(
    sandbox: Sandbox, workspace: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    tools = Toolset(sandbox, workspace, test_command="exit 0")
    script: list[tuple[str, Any, str | None]] = [
        ("delete_everything", "{}", "unknown_tool"),
        ("read_file", '{"path": "a.txt"', "invalid_json"),
        ("read_file", '["a.txt"]', "invalid_arguments"),
        ("read_file", "{}", "invalid_arguments"),
        ("read_file", '{"path": "a.txt", "start_line": "1"}', "invalid_arguments"),
        ("read_file", '{"path": "a.txt", "mode": "r"}', "invalid_arguments"),
        ("read_file", '{"path": "a.txt", "end_line": null}', None),  # null means "left out"
        ("run", '{"command": "sleep 30"}', "timeout"),
        ("run", '{"command": "kill -SEGV $$"}', None),  # a crash is the command's result
        ("run", '{"command": "yes"}', "killed"),
        ("run_tests", "", None),
        ("edit_file", '{"path": "a.txt", "old_string": "beta", "new_string": "gamma"}', "edit_no_match"),
        ("read_file", '{"path": "/etc/shadow"}', "path_outside_workspace"),
        ("read_file", {"path": "a.txt"}, None),  # a harness that already parsed the arguments
        ("read_file", ["a.txt"], "invalid_arguments"),
        ("read_file", {"path": object()}, "invalid_json"),
    ]
    contents = []
    for name, arguments, error in script:
        result = tools.call(name, arguments)
        assert result.record.error == error, (name, arguments, result.content)
        assert result.record.ok == (error is None)
        if error is not None:
            assert result.content.startswith("Error: "), result.content
        contents.append(result.content)
    assert contents[8] == "Killed by signal SIGSEGV.\n(no output)"
    assert contents[9].startswith("Error: killed after writing") and "bytes cut" in contents[9]

    # A bug in a tool and a failing sandbox are reported the same way.
    def broken(*args: object, **kwargs: object) -> str:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(file_tools, "read_file", broken)
    crashed = tools.call("read_file", '{"path": "a.txt"}')
    assert crashed.record.error == "internal_error" and "disk on fire" in crashed.content

    def failing_run(*args: object, **kwargs: object) -> None:
        raise SandboxError("sandbox: setting up the run failed: mount /tmp: No such file or directory")

    monkeypatch.setattr(sandbox, "run", failing_run)
    infra = tools.call("run", '{"command": "true"}')
    assert infra.record.error == "sandbox_error" and "not your fault" in infra.content
    monkeypatch.undo()

    # And the episode carries on.
    final = tools.call("run", '{"command": "cat a.txt"}')
    assert final.record.ok and final.content == "Exit code: 0\nstdout:\nalpha"
    assert len(tools.records) == len(script) + 3
    json.dumps([record.to_dict() for record in tools.records])


@root_only
def test_a_failed_set_up_raises_sandbox_error(
    sandbox: Sandbox, workspace: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = sandbox._spec

    def broken_spec(*args: Any, **kwargs: Any) -> dict[str, Any]:
        result = spec(*args, **kwargs)
        result["mounts"] = [
            (kind, target, str(workspace.root / "missing") if source == str(workspace.tmp) else source)
            for kind, target, source in result["mounts"]
        ]
        return result

    monkeypatch.setattr(sandbox, "_spec", broken_spec)
    with pytest.raises(SandboxError, match="setting up the run failed: mount"):
        sandbox.run(workspace, ["true"])
    result = Toolset(sandbox, workspace, test_command="true").call("run", '{"command": "true"}')
    assert result.record.error == "sandbox_error"


@root_only
def test_killing_the_parent_kills_its_runs(tmp_path: Path) -> None:
    marker = tmp_path / "uid"
    code = textwrap.dedent(
        f"""
        from pathlib import Path
        from prime_composer.sandbox import Sandbox
        sandbox = Sandbox()
        workspace = sandbox.workspace()
        Path({str(marker)!r}).write_text(str(workspace.uid))
        sandbox.run(workspace, "setsid sleep 300 & sleep 300")
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        uid = int(marker.read_text())
        while len(sleepers(uid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(sleepers(uid)) == 2
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 5
    while sleepers(uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sleepers(uid) == []


def sleepers(uid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and entry.stat().st_uid == uid
                and (entry / "comm").read_text().strip() == "sleep"
            ):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def test_no_isolation_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(IsolationUnavailable, match="allow_unisolated"):
        Sandbox(SandboxConfig())


@root_only
def test_a_failing_probe_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Sandbox, "_probe", lambda self: "unshare: Operation not permitted")
    with pytest.raises(IsolationUnavailable, match="unshare: Operation not permitted"):
        Sandbox(SandboxConfig())


def test_unisolated_runs_only_when_allowed_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with (
        caplog.at_level(logging.WARNING),
        Sandbox(SandboxConfig(allow_unisolated=True, limits=LIMITS)) as sandbox,
    ):
        assert not sandbox.isolated
        assert any(
            "SANDBOX IS NOT ISOLATED" in r.message and r.levelno == logging.WARNING for r in caplog.records
        )
        with sandbox.workspace() as workspace:
            result = sandbox.run(workspace, "echo $HOME; sleep 30 & sleep 30")
            assert result.timed_out and not result.isolated
            assert result.stdout == f"{workspace.path}\n"
            done = sandbox.run(workspace, ["python", "-c", "print(6 * 7)"])
            assert done.exit_code == 0 and done.stdout == "42\n"


def test_a_dead_fork_server_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    with (
        Sandbox(SandboxConfig(limits=LIMITS, allow_unisolated=os.geteuid() != 0)) as sandbox,
        sandbox.workspace() as workspace,
    ):
        server = sandbox._spawner._proc
        assert server is not None
        # Killed between runs: the next run starts a new server.
        server.kill()
        server.wait()
        assert sandbox.run(workspace, ["echo", "again"]).stdout == "again\n"
        assert sandbox._spawner._proc is not None and sandbox._spawner._proc.pid != server.pid


@root_only
def test_a_fork_server_killed_during_a_run_takes_the_run_with_it(
    sandbox: Sandbox, workspace: Workspace
) -> None:
    server = sandbox._spawner._proc
    assert server is not None and workspace.uid is not None
    killer = subprocess.Popen(["sh", "-c", f"sleep 0.5; kill -9 {server.pid}"])
    try:
        with pytest.raises(SandboxError, match="without reporting"):
            sandbox.run(
                workspace, "setsid sleep 300 & sleep 300", limits=LIMITS.model_copy(update={"timeout_s": 20})
            )
    finally:
        killer.wait()
    deadline = time.monotonic() + 5
    while sleepers(workspace.uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sleepers(workspace.uid) == []
    assert sandbox.run(workspace, ["true"]).exit_code == 0

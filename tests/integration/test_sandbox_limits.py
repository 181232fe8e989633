"""Every limit of a sandboxed run, hit on purpose: the run ends or fails the way the limit says,
its result names the limit, and nothing of it survives the run."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from prime_composer.config.sandbox import LimitsConfig, SandboxConfig
from prime_composer.sandbox import Sandbox, Workspace

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="isolated runs need root")

LIMITS = LimitsConfig(
    timeout_s=10,
    cpu_s=5,
    memory_mb=256,
    max_processes=16,
    max_file_mb=1,
    max_open_files=32,
    max_output_bytes=1000,
    kill_output_bytes=200_000,
)


def with_limits(**changes: object) -> LimitsConfig:
    return LIMITS.model_copy(update=changes)


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    with Sandbox(SandboxConfig(limits=LIMITS)) as sandbox:
        assert sandbox.isolated
        yield sandbox


@pytest.fixture
def workspace(sandbox: Sandbox) -> Iterator[Workspace]:
    with sandbox.workspace() as workspace:
        yield workspace


def processes_of(uid: int) -> list[int]:
    """Pids of live (not zombie) processes whose real uid is ``uid``, read from /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
            pids.append(int(entry.name))
    return pids


@pytest.mark.slow
def test_wall_clock_timeout_kills_the_tree_with_a_sleeping_grandchild(
    sandbox: Sandbox, workspace: Workspace
) -> None:
    # The grandchild starts its own session, so killing the process group alone would miss it.
    script = "setsid sh -c 'sleep 3; touch escaped' & sleep 100"
    result = sandbox.run(workspace, script, limits=with_limits(timeout_s=1))
    assert result.timed_out and result.killed_by == "timeout" and result.limits_hit == ("timeout",)
    assert result.exit_code is None and result.signal == "SIGKILL"
    assert 1.0 <= result.duration_s < 5
    assert assert_no_processes_left(workspace)
    time.sleep(3.5)
    assert not (workspace.path / "escaped").exists()


@pytest.mark.slow
def test_background_processes_end_with_the_command(sandbox: Sandbox, workspace: Workspace) -> None:
    result = sandbox.run(workspace, "setsid sh -c 'sleep 2; touch escaped' & echo started")
    assert result.exit_code == 0 and result.stdout == "started\n"
    assert assert_no_processes_left(workspace)
    time.sleep(2.5)
    assert not (workspace.path / "escaped").exists()


def assert_no_processes_left(workspace: Workspace) -> bool:
    assert workspace.uid is not None
    deadline = time.monotonic() + 2
    while processes_of(workspace.uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_of(workspace.uid) == []
    return True


def test_fork_bomb_is_held_by_the_process_limit_and_cleaned_up(
    sandbox: Sandbox, workspace: Workspace
) -> None:
    result = sandbox.run(
        workspace, "bomb() { bomb | bomb & }; bomb; sleep 30", limits=with_limits(timeout_s=2)
    )
    assert result.timed_out
    assert "processes" in result.limits_hit
    assert "Resource temporarily unavailable" in result.stderr
    assert assert_no_processes_left(workspace)


def test_process_limit_counts_processes_of_the_workspace(sandbox: Sandbox, workspace: Workspace) -> None:
    script = (
        "import os, time\n"
        "forked = 0\n"
        "try:\n"
        "    for _ in range(40):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(2); os._exit(0)\n"
        "        forked += 1\n"
        "finally:\n"
        "    print(forked, flush=True)\n"
    )
    result = sandbox.run(workspace, ["python", "-c", script], limits=with_limits(max_processes=8))
    assert result.exit_code == 1 and "processes" in result.limits_hit
    assert "BlockingIOError" in result.stderr
    # 8 tasks for the uid: this python and 7 children.
    assert int(result.stdout) == 7


def test_memory_limit_makes_large_allocations_fail(sandbox: Sandbox, workspace: Workspace) -> None:
    small = sandbox.run(workspace, ["python", "-c", "x = bytearray(64 * 2**20); print(len(x))"])
    assert small.exit_code == 0 and small.stdout == f"{64 * 2**20}\n"
    big = sandbox.run(workspace, ["python", "-c", "x = bytearray(512 * 2**20)"])
    assert big.exit_code == 1 and "MemoryError" in big.stderr
    assert big.limits_hit == ("memory",)


def test_cpu_limit_kills_a_busy_loop(sandbox: Sandbox, workspace: Workspace) -> None:
    result = sandbox.run(workspace, ["python", "-c", "while True: pass"], limits=with_limits(cpu_s=1))
    assert result.killed_by == "cpu" and result.limits_hit == ("cpu",)
    assert result.signal in ("SIGXCPU", "SIGKILL") and not result.timed_out
    assert result.cpu_s is not None and result.cpu_s >= 0.9
    assert result.duration_s < LIMITS.timeout_s


def test_file_size_limit(sandbox: Sandbox, workspace: Workspace) -> None:
    # A program that does not handle SIGXFSZ dies of it; the file stops at the limit.
    killed = sandbox.run(workspace, "exec head -c 3000000 /dev/zero > big")
    assert killed.signal == "SIGXFSZ" and killed.killed_by == "file_size"
    assert (workspace.path / "big").stat().st_size == 2**20
    # Python ignores SIGXFSZ and gets EFBIG instead.
    python = sandbox.run(workspace, ["python", "-c", "open('big2', 'wb').write(bytes(2 * 2**20))"])
    assert python.exit_code == 1 and "File too large" in python.stderr
    assert python.limits_hit == ("file_size",)


def test_open_files_limit(sandbox: Sandbox, workspace: Workspace) -> None:
    few = sandbox.run(workspace, ["python", "-c", "fs = [open('/dev/null') for _ in range(20)]"])
    assert few.exit_code == 0
    many = sandbox.run(workspace, ["python", "-c", "fs = [open('/dev/null') for _ in range(100)]"])
    assert many.exit_code == 1 and many.limits_hit == ("open_files",)


def test_output_is_truncated_with_a_marker(sandbox: Sandbox, workspace: Workspace) -> None:
    result = sandbox.run(workspace, ["seq", "1", "20000"])
    expected = "".join(f"{i}\n" for i in range(1, 20001))
    assert result.exit_code == 0 and result.limits_hit == ("output",)
    assert result.stdout_bytes == len(expected)
    assert result.stdout.startswith(expected[:500]) and result.stdout.endswith(expected[-500:])
    assert f"[... {len(expected) - 1000} bytes cut: output is limited to 1000 bytes ...]" in result.stdout


def test_endless_output_is_killed(sandbox: Sandbox, workspace: Workspace) -> None:
    result = sandbox.run(workspace, ["yes"], limits=with_limits(timeout_s=30))
    assert result.killed_by == "output" and not result.timed_out
    assert result.stdout_bytes > LIMITS.kill_output_bytes
    assert result.duration_s < 10
    assert assert_no_processes_left(workspace)


def test_crashes_and_exit_codes_are_results(sandbox: Sandbox, workspace: Workspace) -> None:
    segv = sandbox.run(workspace, ["python", "-c", "import ctypes; ctypes.string_at(0)"])
    assert segv.exit_code is None and segv.signal == "SIGSEGV" and segv.killed_by is None
    code = sandbox.run(workspace, "echo out; echo err >&2; exit 3")
    assert (code.exit_code, code.stdout, code.stderr) == (3, "out\n", "err\n")
    missing = sandbox.run(workspace, ["no-such-program"])
    assert missing.exit_code == 127 and "cannot execute no-such-program" in missing.stderr


def test_stdin_is_fed(sandbox: Sandbox, workspace: Workspace) -> None:
    data = os.urandom(300_000)  # more than a pipe buffer, so writing and reading must interleave
    result = sandbox.run(
        workspace,
        ["python", "-c", "import sys, hashlib; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())"],
        stdin=data,
    )
    import hashlib

    assert result.stdout.strip() == hashlib.sha256(data).hexdigest()


# -- whole-run limits (cgroups) and the workspace's disk quota ---------------------------------

MEMORY_HOG = (
    "import os, sys, time\n"
    "children = []\n"
    "for _ in range(3):\n"
    "    pid = os.fork()\n"
    "    if pid == 0:\n"
    "        block = b'\\x01' * (300 * 2**20)  # resident: every page written\n"
    "        time.sleep(1.5); os._exit(0)\n"
    "    children.append(pid)\n"
    "print(sorted(os.waitpid(pid, 0)[1] for pid in children))\n"
)


def sandbox_cgroup_folders() -> list[Path]:
    """Every cgroup folder a sandbox of this process made (v1: one per hierarchy; v2: one)."""
    return [p for p in Path("/sys/fs/cgroup").rglob(f"prime-composer-sandbox-{os.getpid()}-*") if p.is_dir()]


@pytest.mark.slow
def test_the_whole_run_is_held_by_its_memory_limit(sandbox: Sandbox, workspace: Workspace) -> None:
    assert "memory" in sandbox.cgroup_controllers
    # Per process, 300 MB is well within memory_mb; the three together pass run_memory_mb.
    limits = with_limits(memory_mb=1024, run_memory_mb=512, timeout_s=20)
    result = sandbox.run(workspace, ["python", "-c", MEMORY_HOG], limits=limits)
    assert "memory" in result.limits_hit, result
    statuses = json.loads(result.stdout) if result.stdout else []
    # At least one child was OOM-killed (SIGKILL: wait status 9), or the parent itself was.
    assert result.signal == "SIGKILL" or 9 in statuses, (result.signal, statuses)
    assert result.peak_memory_mb is not None and result.peak_memory_mb <= 512 + 1
    # Under a larger limit the same program runs through: the limit, not the program, stopped it.
    roomy = sandbox.run(
        workspace, ["python", "-c", MEMORY_HOG], limits=with_limits(memory_mb=1024, run_memory_mb=1536)
    )
    assert roomy.exit_code == 0 and json.loads(roomy.stdout) == [0, 0, 0], roomy.stderr
    assert roomy.peak_memory_mb is not None and roomy.peak_memory_mb > 900


def test_refused_forks_are_counted_even_when_the_command_hides_them(
    sandbox: Sandbox, workspace: Workspace
) -> None:
    assert "pids" in sandbox.cgroup_controllers
    script = (
        "import os, time\n"
        "forked = 0\n"
        "for _ in range(20):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(1); os._exit(0)\n"
        "        forked += 1\n"
        "    except OSError:\n"
        "        pass\n"
        "print(forked)\n"
    )
    result = sandbox.run(workspace, ["python", "-c", script], limits=with_limits(max_processes=6))
    assert result.exit_code == 0 and int(result.stdout) == 5  # this python and 5 children
    assert result.limits_hit == ("processes",)


def test_cpu_bandwidth_is_throttled(sandbox: Sandbox, workspace: Workspace) -> None:
    assert "cpu" in sandbox.cgroup_controllers
    busy = (
        "import os, time\n"
        "pid = os.fork()\n"
        "end = time.monotonic() + 1.5\n"
        "while time.monotonic() < end:\n"
        "    pass\n"
        "if not pid: os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "print(sum(os.times()[:4]))\n"
    )
    result = sandbox.run(workspace, ["python", "-c", busy], limits=with_limits(cpus=0.2))
    assert result.exit_code == 0 and "cpus" in result.limits_hit
    # Two busy processes for 1.5 s of wall time, held to a fifth of a core.
    assert float(result.stdout) <= 0.2 * result.duration_s + 0.25


def test_the_workspace_disk_quota_covers_work_and_tmp() -> None:
    config = SandboxConfig(limits=with_limits(max_file_mb=64), workspace_disk_mb=16)
    with Sandbox(config) as sandbox, sandbox.workspace() as workspace:
        small = sandbox.run(workspace, "head -c 10000000 /dev/zero > work.bin && echo ok")
        assert small.stdout == "ok\n"
        # 10 MB in work/ and 10 more in /tmp pass the 16 MiB the two share.
        over = sandbox.run(workspace, "head -c 10000000 /dev/zero > /tmp/tmp.bin")
        assert over.exit_code == 1 and "No space left on device" in over.stderr
        assert over.limits_hit == ("disk",)
        python = sandbox.run(workspace, ["python", "-c", "open('more.bin', 'wb').write(bytes(2**23))"])
        assert python.exit_code == 1 and python.limits_hit == ("disk",)
        assert (workspace.path / "work.bin").stat().st_size == 10_000_000
        root = workspace.root
    assert not root.exists() and str(root) not in Path("/proc/self/mountinfo").read_text()


def test_a_source_larger_than_the_quota_is_refused(tmp_path: Path) -> None:
    (tmp_path / "big.bin").write_bytes(bytes(3 * 2**20))
    root = Path("/var/lib/prime-composer") / f"test-quota-{secrets.token_hex(4)}"
    try:
        with Sandbox(SandboxConfig(root_dir=root, workspace_disk_mb=2)) as sandbox:
            with pytest.raises(ValueError, match=r"does not fit in sandbox\.workspace_disk_mb = 2 MiB"):
                sandbox.workspace(tmp_path)
            assert [p.name for p in root.iterdir() if not p.name.startswith(".")] == []
        assert str(root) not in Path("/proc/self/mountinfo").read_text()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_no_cgroup_folder_outlives_its_run_or_its_sandbox() -> None:
    before = set(sandbox_cgroup_folders())  # the module's sandbox
    with Sandbox(SandboxConfig(limits=LIMITS)) as sandbox, sandbox.workspace() as workspace:
        parents = sorted(set(sandbox_cgroup_folders()) - before)
        assert len(parents) == len(sandbox.cgroup_controllers) == 3  # v1 here: one per hierarchy
        sandbox.run(workspace, "true")
        sandbox.run(workspace, "sleep 30 & sleep 30", limits=with_limits(timeout_s=0.5))
        sandbox.run(workspace, "bomb() { bomb | bomb & }; bomb; sleep 5", limits=with_limits(timeout_s=1))
        assert [list(p.iterdir()) for p in parents] == [
            [f for f in p.iterdir() if f.is_file()] for p in parents
        ]  # files of the folder itself only: no run folder left
    assert set(sandbox_cgroup_folders()) == before


def test_without_cgroups_it_says_so_and_rlimits_hold(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING"):
        sandbox = Sandbox(SandboxConfig(limits=LIMITS, cgroups=False))
    try:
        assert sandbox.cgroup_controllers == ()
        assert "whole-run limits without cgroups for cpu, memory, pids" in caplog.text
        with sandbox.workspace() as workspace:
            script = "import os, time\nwhile True:\n    if os.fork() == 0: time.sleep(2); os._exit(0)\n"
            result = sandbox.run(workspace, ["python", "-c", script], limits=with_limits(max_processes=8))
            assert "processes" in result.limits_hit and "BlockingIOError" in result.stderr
    finally:
        sandbox.close()

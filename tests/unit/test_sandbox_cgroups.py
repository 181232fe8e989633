"""Finding this process's cgroups: v1 hierarchies and v2 from mountinfo, mount roots of a
container's cgroup namespace, and a machine without cgroups saying why."""

from __future__ import annotations

from pathlib import Path

import pytest

from prime_composer.sandbox import cgroups

V1_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 /docker/abc /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V1_SELF = """\
8:pids:/docker/abc/job
4:memory:/process_api/7993
1:cpu:/
0::/
"""


def test_mounts_and_own_paths_are_read() -> None:
    mounts = cgroups._cgroup_mounts(V1_MOUNTINFO)
    assert mounts == {
        "cpu": ("/sys/fs/cgroup/cpu", "/"),
        "memory": ("/sys/fs/cgroup/memory", "/"),
        "pids": ("/sys/fs/cgroup/pids", "/docker/abc"),
        "": ("/sys/fs/cgroup/unified", "/"),
    }
    own = cgroups._own_cgroups(V1_SELF)
    assert own == {"pids": "/docker/abc/job", "memory": "/process_api/7993", "cpu": "/", "": "/"}
    # A hierarchy mounted from below its root (a container's view): paths are relative to it.
    assert cgroups._join(*mounts["pids"], own["pids"]) == Path("/sys/fs/cgroup/pids/job")
    assert cgroups._join(*mounts["memory"], own["memory"]) == Path("/sys/fs/cgroup/memory/process_api/7993")
    assert cgroups._join("/sys/fs/cgroup/pids", "/docker/abc", "/elsewhere") is None


def test_v2_is_used_when_it_offers_every_controller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A fake cgroup2 file system: the kernel's files are plain files here.
    own = tmp_path / "user.slice" / "job"
    own.mkdir(parents=True)
    (own / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (own / "cgroup.subtree_control").write_text("")
    (tmp_path / "mountinfo").write_text(f"41 31 0:38 / {tmp_path} rw - cgroup2 cgroup2 rw\n")
    (tmp_path / "self").write_text("0::/user.slice/job\n")
    monkeypatch.setattr(cgroups, "MOUNTINFO", tmp_path / "mountinfo")
    monkeypatch.setattr(cgroups, "SELF_CGROUP", tmp_path / "self")
    enable = cgroups._enable

    def enable_in_fake(folder: Path, controllers: list[str]) -> None:
        (folder / "cgroup.subtree_control").touch()  # the kernel makes it with the folder
        enable(folder, controllers)

    monkeypatch.setattr(cgroups, "_enable", enable_in_fake)
    found = cgroups.Cgroups.detect()
    assert found.version == 2 and found.missing == {}
    parent = found.parents["memory"]
    assert set(found.parents.values()) == {parent} and parent.parent == own
    assert (own / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    run = found.create(cgroups.RunLimits(memory_bytes=512 * 2**20, max_tasks=10, cpus=0.5))
    folder = run.dirs["memory"]
    assert (folder / "memory.max").read_text() == str(512 * 2**20)
    assert (folder / "pids.max").read_text() == "10"
    assert (folder / "cpu.max").read_text() == "50000 100000"
    assert run.procs_files == [str(folder / "cgroup.procs")]
    for name in ("memory.max", "pids.max", "cpu.max"):  # the kernel would remove these itself
        (folder / name).unlink()
    assert run.remove(timeout_s=0) and not folder.exists()
    (parent / "cgroup.subtree_control").unlink()
    found.close()
    assert not parent.exists()


def test_without_cgroups_every_controller_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mountinfo").write_text("31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n")
    (tmp_path / "self").write_text("0::/\n")
    monkeypatch.setattr(cgroups, "MOUNTINFO", tmp_path / "mountinfo")
    monkeypatch.setattr(cgroups, "SELF_CGROUP", tmp_path / "self")
    found = cgroups.Cgroups.detect()
    assert not found.available and found.version is None
    assert set(found.missing) == {"memory", "pids", "cpu"}
    assert "no cgroup v1 hierarchy with memory is mounted" in found.missing["memory"]

"""File tools on a workspace: line ranges, listing, exact edits, and paths that leave the workspace.

These run the tools in this process on a workspace without a uid (no sandbox needed); the checks
that depend on the workspace's uid (hard links) are in tests/integration/test_sandbox_tools.py.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from prime_composer.sandbox import files
from prime_composer.sandbox.files import ToolError
from prime_composer.sandbox.workspace import IdPool, Workspace


@pytest.fixture
def workspace(tmp_path: Path) -> Workspace:
    source = tmp_path / "task"
    (source / "pkg").mkdir(parents=True)
    (source / "pkg" / "calc.py").write_text(
        "def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n"
    )
    (source / "README.md").write_text("".join(f"line {i}\n" for i in range(1, 1001)))
    (source / ".git").mkdir()
    (source / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (tmp_path / "outside.txt").write_text("secret\n")
    root = tmp_path / "root"
    root.mkdir()
    ws = Workspace.create(root, source, IdPool(root / ".ids", base=1000, size=8), own_uid=False)
    yield ws
    ws.close()


def test_the_workspace_is_a_copy(workspace: Workspace, tmp_path: Path) -> None:
    (workspace.path / "pkg" / "calc.py").write_text("changed")
    assert (tmp_path / "task" / "pkg" / "calc.py").read_text().startswith("def add")


def test_read_file_line_ranges(workspace: Workspace) -> None:
    text = files.read_file(workspace, "README.md", 10, 12, max_lines=500)
    assert text == "10\tline 10\n11\tline 11\n12\tline 12"
    paged = files.read_file(workspace, "README.md", 1, None, max_lines=3)
    assert paged == "1\tline 1\n2\tline 2\n3\tline 3\n[lines 1-3 of 1000; read on with start_line=4]"
    last = files.read_file(workspace, "README.md", 999, 5000, max_lines=500)
    assert last == " 999\tline 999\n1000\tline 1000"


@pytest.mark.parametrize(
    ("start", "end", "kind"),
    [(0, None, "invalid_arguments"), (5, 4, "invalid_arguments"), (1001, None, "invalid_arguments")],
)
def test_read_file_bad_ranges(workspace: Workspace, start: int, end: int | None, kind: str) -> None:
    with pytest.raises(ToolError) as info:
        files.read_file(workspace, "README.md", start, end, max_lines=10)
    assert info.value.kind == kind


def test_list_files_is_sorted_depth_first_and_skips_noise(workspace: Workspace) -> None:
    os.symlink("pkg/calc.py", workspace.path / "alias.py")
    listing = files.list_files(workspace, ".", max_entries=100, skip_dirs=[".git"])
    assert listing.splitlines() == [
        ".git/ (not listed)",
        "README.md",
        "alias.py -> pkg/calc.py",
        "pkg/",
        "pkg/calc.py",
    ]
    capped = files.list_files(workspace, ".", max_entries=2, skip_dirs=[".git"])
    assert capped.splitlines()[-1].startswith("[... more entries not shown (limit 2)")
    assert files.list_files(workspace, "pkg", max_entries=100, skip_dirs=[]) == "pkg/calc.py"


def test_edit_file_replaces_the_one_occurrence(workspace: Workspace) -> None:
    message = files.edit_file(
        workspace, "pkg/calc.py", "def add(a, b):\n    return a - b", "def add(a, b):\n    return a + b"
    )
    assert message == "Edited pkg/calc.py: replaced 1 occurrence (now lines 1-2)."
    assert (workspace.path / "pkg" / "calc.py").read_text() == (
        "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
    )


def test_edit_file_absent_and_ambiguous_strings_are_clear_errors(workspace: Workspace) -> None:
    before = (workspace.path / "pkg" / "calc.py").read_text()
    with pytest.raises(ToolError, match="not found") as absent:
        files.edit_file(workspace, "pkg/calc.py", "return a * b", "return a + b")
    assert absent.value.kind == "edit_no_match"
    with pytest.raises(ToolError, match=r"occurs 2 times .* lines 2, 6") as ambiguous:
        files.edit_file(workspace, "pkg/calc.py", "return a - b", "return a + b")
    assert ambiguous.value.kind == "edit_ambiguous"
    assert (workspace.path / "pkg" / "calc.py").read_text() == before


def test_write_file_creates_folders_and_overwrites(workspace: Workspace) -> None:
    assert files.write_file(workspace, "new/deep/f.txt", "x\n") == "Created new/deep/f.txt (2 bytes)."
    assert files.write_file(workspace, "new/deep/f.txt", "yy") == "Overwrote new/deep/f.txt (2 bytes)."
    assert (workspace.path / "new" / "deep" / "f.txt").read_text() == "yy"
    with pytest.raises(ToolError) as info:
        files.write_file(workspace, "pkg", "x")
    assert info.value.kind == "is_a_folder"
    with pytest.raises(ToolError) as parent_is_file:
        files.write_file(workspace, "README.md/x", "x")
    assert parent_is_file.value.kind == "not_a_folder"


@pytest.mark.parametrize("path", ["../outside.txt", "/etc/passwd", "pkg/../../outside.txt"])
def test_paths_outside_are_refused(workspace: Workspace, path: str) -> None:
    for call in (
        lambda: files.read_file(workspace, path, 1, None, max_lines=10),
        lambda: files.write_file(workspace, path, "pwned"),
        lambda: files.edit_file(workspace, path, "secret", "pwned"),
        lambda: files.list_files(workspace, path, max_entries=10, skip_dirs=[]),
    ):
        with pytest.raises(ToolError) as info:
            call()
        assert info.value.kind == "path_outside_workspace"
    assert (workspace.root.parent.parent / "outside.txt").read_text() == "secret\n"


def test_symlinks_pointing_out_are_refused(workspace: Workspace, tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    os.symlink(outside, workspace.path / "link.txt")
    os.symlink(tmp_path, workspace.path / "linkdir")
    for path in ("link.txt", "linkdir/outside.txt"):
        with pytest.raises(ToolError, match="outside the workspace"):
            files.read_file(workspace, path, 1, None, max_lines=10)
        with pytest.raises(ToolError, match="outside the workspace"):
            files.write_file(workspace, path, "pwned")
    with pytest.raises(ToolError, match="outside the workspace"):
        files.write_file(workspace, "linkdir/new.txt", "pwned")
    assert outside.read_text() == "secret\n"
    assert not (tmp_path / "new.txt").exists()
    # A symlink that stays inside is followed.
    os.symlink("README.md", workspace.path / "inside.md")
    assert files.read_file(workspace, "inside.md", 1, 1, max_lines=10) == "1\tline 1"


def test_a_fifo_is_refused_without_blocking(workspace: Workspace) -> None:
    os.mkfifo(workspace.path / "pipe")
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            files.read_file(workspace, "pipe", 1, None, max_lines=10)
        except ToolError as e:
            outcome.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=5)
    assert not reader.is_alive(), "read_file blocked on a FIFO"
    assert isinstance(outcome[0], ToolError) and outcome[0].kind == "not_a_file"


def test_binary_and_missing_files(workspace: Workspace) -> None:
    (workspace.path / "blob.bin").write_bytes(b"\x7fELF\0\0\1")
    with pytest.raises(ToolError, match="binary") as binary:
        files.read_file(workspace, "blob.bin", 1, None, max_lines=10)
    assert binary.value.kind == "binary_file"
    with pytest.raises(ToolError, match="does not exist") as missing:
        files.read_file(workspace, "nope.py", 1, None, max_lines=10)
    assert missing.value.kind == "not_found"


def test_close_removes_folders_without_permissions(workspace: Workspace) -> None:
    locked = workspace.path / "locked"
    (locked / "inner").mkdir(parents=True)
    (locked / "inner" / "f").write_text("x")
    os.chmod(locked / "inner", 0)
    os.chmod(locked, 0)
    workspace.close()
    assert not workspace.root.exists()


def test_ids_are_exclusive_and_stale_folders_are_swept(tmp_path: Path) -> None:
    pool = IdPool(tmp_path / ".ids", base=1000, size=2)
    first, second = (
        Workspace.create(tmp_path, None, pool, own_uid=False),
        Workspace.create(tmp_path, None, pool, own_uid=False),
    )
    ids = {ws.root.name.split("-")[0] for ws in (first, second)}
    assert ids == {"1000", "1001"}
    with pytest.raises(RuntimeError, match="all 2 workspace ids"):
        Workspace.create(tmp_path, None, pool, own_uid=False)
    # A folder whose id is held is live; one whose id is free was left by a crashed process.
    stale = tmp_path / f"{second.root.name.split('-')[0]}-deadbeef"
    second.close()
    stale.mkdir()
    assert IdPool(tmp_path / ".ids", base=1000, size=2).sweep(tmp_path) == 1
    assert first.root.exists() and not stale.exists()
    first.close()

"""The file tools' work on a workspace: list, read (line ranges), write, exact-string edit.

They run in the calling process, not in a sandboxed one, because a subprocess per file read
would cost ~30 ms for microseconds of work. What keeps that safe:

- every path goes through ``Workspace.resolve`` (symlinks resolved; outside the workspace is
  refused);
- in isolated mode a file is only read or written if the workspace's uid owns it, so a hard link
  to a file outside (same file system) is refused too, and created files and folders are handed
  to that uid;
- only regular files are opened, with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO cannot block us);
- in isolated mode no sandboxed process outlives its run, and ``Toolset`` runs one call at a time
  per workspace, so nothing can swap a path between the check and the open while a tool runs.

Errors the model should see are ``ToolError``s with a kind and a message that says what to do.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

from prime_composer.sandbox.workspace import PathOutsideWorkspace, Workspace

BINARY_PROBE_BYTES = 8192


class ToolError(Exception):
    """A tool call the tool could not carry out; ``kind`` names the failure, the message is for the model."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def resolve(workspace: Workspace, path: str) -> Path:
    try:
        return workspace.resolve(path)
    except PathOutsideWorkspace as e:
        raise ToolError("path_outside_workspace", f"{e}; paths must stay inside the workspace") from None


def list_files(workspace: Workspace, path: str, *, max_entries: int, skip_dirs: Sequence[str]) -> str:
    top = resolve(workspace, path)
    if not top.is_dir():
        raise ToolError("not_found", f"{path!r} is not a folder in the workspace")
    entries: list[str] = []
    for line in _walk(workspace, top, set(skip_dirs)):
        if len(entries) == max_entries:
            entries.append(f"[... more entries not shown (limit {max_entries}); list a sub-folder]")
            break
        entries.append(line)
    return "\n".join(entries) if entries else "(empty folder)"


def _walk(workspace: Workspace, top: Path, skip: set[str]) -> Iterator[str]:
    """Depth first, sorted by name: ``dir/``, then what is in it; symlinks shown, never followed."""
    stack = [iter(_sorted_entries(top))]
    while stack:
        entry = next(stack[-1], None)
        if entry is None:
            stack.pop()
            continue
        rel = workspace.relative(Path(entry.path))
        if entry.is_symlink():
            yield f"{rel} -> {os.readlink(entry.path)}"
        elif entry.is_dir():
            yield f"{rel}/" + (" (not listed)" if entry.name in skip else "")
            if entry.name not in skip:
                stack.append(iter(_sorted_entries(Path(entry.path))))
        else:
            yield rel


def _sorted_entries(folder: Path) -> list[os.DirEntry[str]]:
    with os.scandir(folder) as it:
        return sorted(it, key=lambda entry: entry.name)


def read_file(
    workspace: Workspace, path: str, start_line: int, end_line: int | None, *, max_lines: int
) -> str:
    if start_line < 1:
        raise ToolError("invalid_arguments", "start_line counts from 1")
    if end_line is not None and end_line < start_line:
        raise ToolError("invalid_arguments", f"end_line ({end_line}) is before start_line ({start_line})")
    data = _read_bytes(workspace, path)
    if b"\0" in data[:BINARY_PROBE_BYTES]:
        raise ToolError("binary_file", f"{path!r} is a binary file ({len(data)} bytes); it is not shown")
    lines = data.decode(errors="replace").splitlines()
    if not lines:
        return f"({path} is empty)"
    if start_line > len(lines):
        raise ToolError(
            "invalid_arguments", f"start_line {start_line} is past the end of {path!r} ({len(lines)} lines)"
        )
    last = min(len(lines), end_line or len(lines), start_line + max_lines - 1)
    width = len(str(last))
    body = "\n".join(f"{n:>{width}}\t{lines[n - 1]}" for n in range(start_line, last + 1))
    if last < len(lines) and (end_line is None or last < end_line):
        body += f"\n[lines {start_line}-{last} of {len(lines)}; read on with start_line={last + 1}]"
    return body


def write_file(workspace: Workspace, path: str, content: str) -> str:
    target = resolve(workspace, path)
    if target == workspace.path or target.is_dir():
        raise ToolError("is_a_folder", f"{path!r} is a folder")
    _make_parents(workspace, target.parent)
    data = content.encode()
    existed = os.path.lexists(target)
    fd = _open(workspace, target, os.O_WRONLY, path) if existed else _create(workspace, target)
    try:
        os.ftruncate(fd, 0)
        _write_all(fd, data)
    finally:
        os.close(fd)
    return f"{'Overwrote' if existed else 'Created'} {workspace.relative(target)} ({len(data)} bytes)."


def edit_file(workspace: Workspace, path: str, old_string: str, new_string: str) -> str:
    if not old_string:
        raise ToolError("invalid_arguments", "old_string is empty; use write_file to create a file")
    if old_string == new_string:
        raise ToolError("invalid_arguments", "old_string and new_string are the same; nothing to change")
    target = resolve(workspace, path)
    try:
        text = _read_bytes(workspace, path).decode()
    except UnicodeDecodeError:
        raise ToolError("binary_file", f"{path!r} is not UTF-8 text; it cannot be edited") from None
    count = text.count(old_string)
    if count == 0:
        raise ToolError(
            "edit_no_match",
            f"old_string was not found in {path!r}; it must match the file exactly, whitespace and "
            "indentation included (read_file shows the current text; leave out its line numbers)",
        )
    if count > 1:
        lines = _match_lines(text, old_string)
        raise ToolError(
            "edit_ambiguous",
            f"old_string occurs {count} times in {path!r} (starting on lines {', '.join(map(str, lines))}); "
            "include more of the surrounding text so that it occurs exactly once",
        )
    start = text.index(old_string)
    new_text = text[:start] + new_string + text[start + len(old_string) :]
    fd = _open(workspace, target, os.O_WRONLY, path)
    try:
        os.ftruncate(fd, 0)
        _write_all(fd, new_text.encode())
    finally:
        os.close(fd)
    first = text.count("\n", 0, start) + 1
    last = first + new_string.count("\n")
    where = f"line {first}" if first == last else f"lines {first}-{last}"
    return f"Edited {workspace.relative(target)}: replaced 1 occurrence (now {where})."


def _match_lines(text: str, needle: str, limit: int = 10) -> list[int]:
    """The distinct line numbers where the first occurrences of ``needle`` start."""
    lines: list[int] = []
    start = 0
    while len(lines) < limit and (at := text.find(needle, start)) != -1:
        line = text.count("\n", 0, at) + 1
        if not lines or lines[-1] != line:
            lines.append(line)
        start = at + 1
    return lines


def _read_bytes(workspace: Workspace, path: str) -> bytes:
    target = resolve(workspace, path)
    fd = _open(workspace, target, os.O_RDONLY, path)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _open(workspace: Workspace, target: Path, flags: int, shown: str) -> int:
    """Open a regular file of the workspace (see the module docstring for the checks).

    Never pass ``O_TRUNC``: the file must pass the checks before anything changes it.
    """
    try:
        fd = os.open(target, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except FileNotFoundError:
        raise ToolError("not_found", f"{shown!r} does not exist") from None
    except IsADirectoryError:
        raise ToolError("is_a_folder", f"{shown!r} is a folder") from None
    except OSError as e:
        raise ToolError("os_error", f"cannot open {shown!r}: {e.strerror}") from None
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = ToolError("not_a_file", f"{shown!r} is not a regular file")
    elif workspace.uid is not None and info.st_uid != workspace.uid:
        problem = ToolError("path_outside_workspace", f"{shown!r} is a link to a file outside the workspace")
    if problem is not None:
        os.close(fd)
        raise problem
    os.set_blocking(fd, True)
    return fd


def _create(workspace: Workspace, target: Path) -> int:
    """Create a new file (never an existing one: ``O_EXCL``) and hand it to the workspace's uid."""
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    if workspace.uid is not None:
        os.fchown(fd, workspace.uid, workspace.uid)
    return fd


def _make_parents(workspace: Workspace, folder: Path) -> None:
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    if not folder.is_dir():
        raise ToolError("not_a_folder", f"{workspace.relative(folder)!r} is a file, not a folder")
    for parent in reversed(missing):
        parent.mkdir()
        workspace.give(parent)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except OSError as e:
            raise ToolError("os_error", f"writing failed: {e.strerror}") from None

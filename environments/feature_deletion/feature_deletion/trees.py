"""Which files go where: the agent's source files, and the trees grading and probing run in.

A project's files are of two sorts. **Source files** are the ``.py`` files under its packages
that are not tests (``test_*.py``, ``*_test.py``, ``conftest.py``, anything under a test path);
they are what an agent may change. Everything else (tests, ``conftest.py``, pytest
configuration, data files) is **pristine**: it always comes from the built project.

- ``collect_sources`` reads the source files out of an agent's workspace: regular files only
  (symlinks, FIFOs and devices are skipped, files are opened with ``O_NOFOLLOW``), bounded in
  number and size. Bytecode, ``.pth`` files, a ``sitecustomize.py`` outside a package, or new
  top-level modules never count: only ``.py`` files inside the package folders (or the module
  files of a single-module project) do.
- ``stage_test_tree`` writes the pristine tree without its source files, plus the given ones:
  where the grader runs pytest.
- ``stage_probe_tree`` writes only the package folders (their data files and the given source
  files, no tests): where the probe runs, so that no expected value is anywhere in reach.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from feature_deletion.spec import ProjectSpec

MAX_SOURCE_FILES = 2000
MAX_SOURCE_BYTES = 32 * 2**20


class SourceError(ValueError):
    """The agent's source files cannot be graded (too many, too large); the message says why."""


def is_test_file(spec: ProjectSpec, rel: str) -> bool:
    """Whether ``rel`` (relative to the project root) is a test, a conftest or under a test path."""
    name = rel.rsplit("/", 1)[-1]
    if name == "conftest.py" or name.startswith("test_") or name.endswith("_test.py"):
        return True
    return any(rel == t or rel.startswith(t.rstrip("/") + "/") for t in spec.tests)


def is_source_file(spec: ProjectSpec, rel: str) -> bool:
    """Whether ``rel`` is a file an agent may change: a non-test ``.py`` inside a package (or a
    single-module project's module)."""
    if not rel.endswith(".py") or is_test_file(spec, rel):
        return False
    for package in spec.package_paths:
        if package.endswith(".py") and rel == package:
            return True
        if not package.endswith(".py") and rel.startswith(package + "/"):
            return True
    return False


def pristine_sources(spec: ProjectSpec, tree: Path) -> dict[str, bytes]:
    """The source files of a built project."""
    return {rel: (tree / rel).read_bytes() for rel in _walk(tree) if is_source_file(spec, rel)}


def collect_sources(spec: ProjectSpec, root: Path) -> dict[str, bytes]:
    """The source files in an agent's workspace ``root`` (see the module docstring)."""
    sources: dict[str, bytes] = {}
    total = 0
    for rel in _walk(root):
        if not is_source_file(spec, rel):
            continue
        try:
            fd = os.open(root / rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                continue
            data = f.read(MAX_SOURCE_BYTES + 1)
        total += len(data)
        if len(sources) >= MAX_SOURCE_FILES or total > MAX_SOURCE_BYTES:
            raise SourceError(
                f"the workspace's source files pass the grading limits ({MAX_SOURCE_FILES} files, "
                f"{MAX_SOURCE_BYTES // 2**20} MiB)"
            )
        sources[rel] = data
    return sources


def _walk(root: Path) -> list[str]:
    """Relative paths of the regular files under ``root`` (never following symlinks), sorted."""
    found = []
    for folder, dirs, files in os.walk(root, followlinks=False):
        base = Path(folder).relative_to(root)
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(folder, d))]
        for name in files:
            path = os.path.join(folder, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                found.append((base / name).as_posix())
    return sorted(found)


def stage_test_tree(spec: ProjectSpec, tree: Path, sources: dict[str, bytes], dest: Path) -> None:
    """``dest`` := the pristine tree without its source files, plus ``sources``."""
    for rel in _walk(tree):
        if not is_source_file(spec, rel):
            _copy(tree / rel, dest / rel)
    _write_sources(sources, dest)


def stage_probe_tree(spec: ProjectSpec, tree: Path, sources: dict[str, bytes], dest: Path) -> None:
    """``dest`` := the package folders' pristine data files (no tests, no sources), plus ``sources``."""
    dest.mkdir(parents=True, exist_ok=True)
    for rel in _walk(tree):
        inside = any(rel.startswith(p + "/") for p in spec.package_paths if not p.endswith(".py"))
        if inside and not is_test_file(spec, rel) and not rel.endswith(".py"):
            _copy(tree / rel, dest / rel)
    _write_sources(sources, dest)


def _write_sources(sources: dict[str, bytes], dest: Path) -> None:
    for rel, data in sources.items():
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)

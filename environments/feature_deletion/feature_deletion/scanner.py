"""The visibility scan's sandboxed half: walk everything sandboxed code can read, looking for a copy
of a project in any form. Stdlib only; sent as ``python -s -B -c <text>`` with a JSON job on
stdin and never stored where sandboxed code could edit it (like ``sandboxed.py``).

A *copy* of a project (``visibility.fingerprint`` computes what to look for, on the host) is any
of these, as a plain file, or as a member of an archive (``.whl``, ``.zip``, ``.egg``, ``.pyz``,
``.jar``, ``.tar``, ``.tar.gz``/``.tgz``, ``.tar.bz2``, ``.tar.xz``), archives inside archives
included (up to ``MAX_DEPTH`` levels):

- a source file named like one of the project's modules that holds at least two of that
  module's longest lines;
- bytecode (``<module>.pyc``, ``<module>.cpython-311.pyc``, ...) of one of its modules: the
  names and long string constants (docstrings) of the module's code objects are stored verbatim
  in a ``.pyc``, so a file holding enough of them is a compiled copy;
- a dist-info, egg-info, sdist, wheel, egg or zip named after the project.

Output: one JSON line per finding, ``{"project": slug, "path": ..., "why": ...}`` (a member of an
archive is named ``archive!member``), then ``{"end": {"files": N, "archives": M, "unreadable": K, "found": {slug: count}}}`` (at most
``MAX_REPORTED`` findings are written per project; ``found`` counts them all).
Unreadable files and folders are skipped: what the sandboxed user cannot read is no copy.
"""

from __future__ import annotations

import io
import json
import os
import re
import stat
import sys
import tarfile
import zipfile
from typing import Any

ZIP_SUFFIXES = (".whl", ".zip", ".egg", ".pyz", ".jar")
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
MAX_DEPTH = 3
"""Archives inside archives are opened this many levels deep."""
MAX_MEMBER_BYTES = 64 * 2**20
"""Largest archive member read (a nested archive is read into memory to be opened)."""
MAX_REPORTED = 100
"""Findings written per project (the rest are only counted)."""
MAX_SOURCE_BYTES = 8 * 2**20
"""Largest source or bytecode file compared with a project's lines and names."""
_PYC = re.compile(r"^(?P<stem>[^.]+)(\.[A-Za-z0-9_-]+)?\.pyc$")


class Project:
    def __init__(self, job: dict[str, Any]) -> None:
        self.slug: str = job["slug"]
        self.dist = re.compile(job["dist_regex"], re.IGNORECASE)
        self.modules: dict[str, dict[str, Any]] = job["modules"]
        """``name.py`` -> ``{"lines": [...], "names": [...], "need_lines": n, "need_names": m}``."""
        self.stems = {name[:-3]: name for name in self.modules}


class Scanner:
    def __init__(self, projects: list[Project], out: Any) -> None:
        self.projects = projects
        self.out = out
        self.num_files = 0
        self.num_archives = 0
        self.num_unreadable = 0
        self.module_names = {name for p in projects for name in p.modules}
        self.stems = {stem for p in projects for stem in p.stems}
        self.seen: set[tuple[str, str]] = set()
        self.num_found: dict[str, int] = {}

    def report(self, project: Project, path: str, why: str) -> None:
        if (project.slug, path) in self.seen:
            return
        self.seen.add((project.slug, path))
        self.num_found[project.slug] = self.num_found.get(project.slug, 0) + 1
        if self.num_found[project.slug] > MAX_REPORTED:
            return  # counted in the end line; the output stays small enough to come back whole
        self.out.write(json.dumps({"project": project.slug, "path": path, "why": why}) + "\n")
        self.out.flush()

    def wanted(self, name: str) -> bool:
        """Whether a file of this name must be read (a module, bytecode or an archive)."""
        lower = name.lower()
        if name in self.module_names or lower.endswith(ZIP_SUFFIXES + TAR_SUFFIXES):
            return True
        match = _PYC.match(name)
        return match is not None and match.group("stem") in self.stems

    def check_name(self, name: str, path: str) -> None:
        """Dist-info, egg-info, sdists and wheels named after a project (files or folders)."""
        for project in self.projects:
            if project.dist.match(name):
                self.report(project, path, "named after the project")

    def check_content(self, name: str, path: str, data: bytes, depth: int) -> None:
        lower = name.lower()
        if lower.endswith(ZIP_SUFFIXES):
            self.scan_zip(path, io.BytesIO(data), depth + 1)
        elif lower.endswith(TAR_SUFFIXES):
            self.scan_tar(path, io.BytesIO(data), depth + 1)
        else:
            self.check_code(name, path, data)

    def check_code(self, name: str, path: str, data: bytes) -> None:
        match = _PYC.match(name)
        for project in self.projects:
            if name in project.modules:
                module = project.modules[name]
                text = data.decode("utf-8", "replace")
                found = sum(line in text for line in module["lines"])
                if module["lines"] and found >= module["need_lines"]:
                    self.report(project, path, f"source: {found} of the module's longest lines")
            elif match is not None and match.group("stem") in project.stems:
                module = project.modules[project.stems[match.group("stem")]]
                found = sum(n.encode() in data for n in module["names"])
                if module["names"] and found >= module["need_names"]:
                    self.report(project, path, f"bytecode: {found} of the module's names and strings")

    # -- the file system -----------------------------------------------------------------------

    def walk(self, roots: list[str], prune: set[str]) -> None:
        stack = list(reversed(roots))
        while stack:
            folder = stack.pop()
            try:
                entries = sorted(os.scandir(folder), key=lambda e: e.name)
            except OSError:
                self.num_unreadable += 1
                continue
            for entry in entries:
                path = entry.path
                try:
                    mode = entry.stat(follow_symlinks=False).st_mode
                except OSError:
                    continue
                if stat.S_ISLNK(mode):
                    continue  # its target is scanned where it lies, if it is visible
                # A hidden folder is an empty one at the same path: only a folder with something
                # in it, or a file, is a copy.
                if not stat.S_ISDIR(mode) or _has_entries(path):
                    self.check_name(entry.name, path)
                if stat.S_ISDIR(mode):
                    if path not in prune:
                        stack.append(path)
                elif stat.S_ISREG(mode):
                    self.num_files += 1
                    if self.wanted(entry.name):
                        self.scan_file(entry.name, path, entry.stat(follow_symlinks=False).st_size)

    def scan_file(self, name: str, path: str, size: int) -> None:
        lower = name.lower()
        try:
            if lower.endswith(ZIP_SUFFIXES):
                with open(path, "rb") as f:
                    self.scan_zip(path, f, 1)
            elif lower.endswith(TAR_SUFFIXES):
                with open(path, "rb") as f:
                    self.scan_tar(path, f, 1)
            elif size <= MAX_SOURCE_BYTES:
                with open(path, "rb") as f:
                    self.check_code(name, path, f.read())
        except OSError:
            self.num_unreadable += 1

    def scan_zip(self, path: str, file: Any, depth: int) -> None:
        self.num_archives += 1
        try:
            with zipfile.ZipFile(file) as archive:
                for info in archive.infolist():
                    self.member(path, info.filename, info.file_size, info.is_dir(), archive.read, info, depth)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError):
            self.num_unreadable += 1

    def scan_tar(self, path: str, file: Any, depth: int) -> None:
        self.num_archives += 1
        try:
            with tarfile.open(fileobj=file, mode="r:*") as archive:

                def read(member: tarfile.TarInfo) -> bytes:
                    extracted = archive.extractfile(member)
                    return extracted.read() if extracted is not None else b""

                for info in archive:
                    if info.isdir() or info.isreg():
                        self.member(path, info.name, info.size, info.isdir(), read, info, depth)
        except (tarfile.TarError, OSError, ValueError, EOFError):
            self.num_unreadable += 1

    def member(
        self, archive: str, name: str, size: int, is_dir: bool, read: Any, info: Any, depth: int
    ) -> None:
        parts = [p for p in name.split("/") if p]
        if not parts:
            return
        where = f"{archive}!{'/'.join(parts)}"
        # A member ``a-1.0.dist-info/RECORD`` names its folder only in its path: check each part.
        for i, part in enumerate(parts):
            self.check_name(part, f"{archive}!{'/'.join(parts[: i + 1])}")
        base = parts[-1]
        if is_dir or not self.wanted(base):
            return
        lower = base.lower()
        if lower.endswith(ZIP_SUFFIXES + TAR_SUFFIXES) and depth >= MAX_DEPTH:
            return
        limit = MAX_MEMBER_BYTES if lower.endswith(ZIP_SUFFIXES + TAR_SUFFIXES) else MAX_SOURCE_BYTES
        if size > limit:
            self.num_unreadable += 1
            return
        try:
            data = read(info)
        except Exception:  # a corrupt member is no copy; count it and go on
            self.num_unreadable += 1
            return
        self.check_content(base, where, data, depth)


def _has_entries(path: str) -> bool:
    try:
        with os.scandir(path) as entries:
            return any(True for _ in entries)
    except OSError:
        return False


def main() -> None:
    job = json.loads(sys.stdin.read())
    projects = [Project(p) for p in job["projects"]]
    scanner = Scanner(projects, sys.stdout)
    scanner.walk(job["roots"], set(job["prune"]))
    end = {
        "files": scanner.num_files,
        "archives": scanner.num_archives,
        "unreadable": scanner.num_unreadable,
        "found": scanner.num_found,
    }
    sys.stdout.write(json.dumps({"end": end}) + "\n")


if __name__ == "__main__":
    main()

"""What a sandboxed run sees of the file system: an allowlist, and nothing else of the host.

Each run's init (``_init.py``) builds a new root on an empty tmpfs and ``pivot_root``s into it, so
the host's tree is not hidden piece by piece but absent: only what this plan binds exists inside.
The plan, computed once per ``Sandbox``, is a list of ``(kind, target, source)`` operations,
applied parents first (sorted by the target's depth):

- ``ro``: ``source`` bound read-only at ``target`` (the system runtime: ``/usr``, the dynamic
  loader's and the C library's files in ``/etc``, ...; the Python environment and its base
  interpreter; ``exposed_paths``);
- ``rw``: bound writable (the workspace's ``work/`` and ``tmp/`` at their own paths; ``tmp/`` also
  on every private tmp path);
- ``hide``: an empty read-only tmpfs over a folder inside something bound (``hidden_paths``, e.g.
  a base interpreter's ``site-packages``);
- ``symlink``: a link recreated at ``target`` pointing to ``source`` (``/bin -> usr/bin``, a uv
  interpreter's ``cpython-3.12-...`` link to its patch version), so every path the command is
  given resolves inside as it does outside;
- ``dev``: a device node bound from the host (``/dev/null``, ``/dev/urandom``, ...);
- ``proc``: a fresh ``/proc`` of the run's pid namespace.

Because a deeper operation runs after a shallower one, the Python environment is visible even
where a private tmp (a venv under ``/tmp``) or a hidden folder would cover it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

Mount = tuple[str, str, str]
"""``(kind, target, source)``; plain tuples, because the spec crosses to ``_init.py`` as marshal."""

_VIRTUAL = ("/proc", "/sys", "/dev")
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")
_DEV_LINKS = (
    ("/dev/fd", "/proc/self/fd"),
    ("/dev/stdin", "/proc/self/fd/0"),
    ("/dev/stdout", "/proc/self/fd/1"),
    ("/dev/stderr", "/proc/self/fd/2"),
)


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def symlinks_on(path: str, depth: int = 0) -> list[tuple[str, str]]:
    """Every symlink met resolving ``path`` (its own components and their targets' components),
    as ``(link, target)``; links into ``/proc``, ``/sys`` or ``/dev`` are kept but not followed."""
    if depth > 40:
        raise ValueError(f"sandbox: too many levels of symbolic links resolving {path!r}")
    found: list[tuple[str, str]] = []
    current = "/"
    for part in Path(path).parts[1:]:
        candidate = os.path.join(current, part)
        if os.path.islink(candidate):
            target = os.readlink(candidate)
            found.append((candidate, target))
            absolute = os.path.normpath(os.path.join(current, target))
            if not any(_under(absolute, v) for v in _VIRTUAL):
                found += symlinks_on(absolute, depth + 1)
            current = os.path.realpath(candidate)
        else:
            current = candidate
    return found


def python_dirs(env: Path) -> list[str]:
    """Paths the Python environment needs visible: itself, and every path its interpreter links
    and ``pyvenv.cfg``'s ``home`` name (a venv's base interpreter)."""
    paths = [str(env)]
    for name in ("python3", "python"):
        interpreter = env / "bin" / name
        if interpreter.exists():
            real = os.path.realpath(interpreter)
            paths.append(str(Path(real).parent.parent))
            paths += [link for link, _ in symlinks_on(str(interpreter))]
            break
    config = env / "pyvenv.cfg"
    if config.is_file():
        for line in config.read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home" and os.path.isdir(value.strip()):
                paths.append(value.strip())
    return paths


def plan(
    *,
    system_paths: Sequence[Path],
    python_env: Path,
    exposed_paths: Sequence[Path],
    hidden_paths: Sequence[Path],
    private_tmp_paths: Sequence[Path],
) -> list[Mount]:
    """The operations every run shares (see the module docstring); the workspace's own come
    from ``for_workspace``."""
    python = python_dirs(python_env)
    wanted = [str(p) for p in system_paths if os.path.lexists(p)] + [str(p) for p in exposed_paths] + python
    links: dict[str, str] = {}
    binds: set[str] = set()
    for path in wanted:
        for link, target in symlinks_on(path):
            links[link] = target
        real = os.path.realpath(path)
        if os.path.exists(real) and not any(_under(real, v) for v in _VIRTUAL):
            binds.add(real)
    python_real = {os.path.realpath(p) for p in python}
    hides: set[str] = set()
    for hidden in hidden_paths:
        real = os.path.realpath(hidden)
        if not os.path.isdir(real) or not any(_under(real, b) for b in binds):
            continue  # absent inside anyway
        if real in python_real:
            logger.warning("sandbox: hidden_paths entry %s is the Python environment; it stays visible", real)
            continue
        hides.add(real)
    # A hidden folder inside another hidden one is gone already (the outer empty tmpfs covers it,
    # and mounting over it would fail on its missing mount point).
    hides = {h for h in hides if not any(o != h and _under(h, o) for o in hides)}
    tmp_targets = sorted({os.path.realpath(p) for p in private_tmp_paths})
    covers = sorted(binds | hides | set(tmp_targets))

    def redundant(bind: str) -> bool:
        # Already visible through a bind above it, with nothing covering it in between.
        above = [c for c in covers if c != bind and _under(bind, c)]
        return bool(above) and max(above, key=len) in binds

    mounts: list[Mount] = [("ro", b, b) for b in binds if not redundant(b)]
    mounts += [("hide", h, "") for h in hides]
    mounts += [("symlink", link, target) for link, target in links.items() if link not in binds]
    mounts += [("dev", d, d) for d in DEVICES if os.path.exists(d)]
    mounts += [("symlink", link, target) for link, target in _DEV_LINKS]
    mounts += [("proc", "/proc", "proc")]
    mounts += [("tmp", t, "") for t in tmp_targets]
    return mounts


def for_workspace(shared: Iterable[Mount], work: Path, tmp: Path) -> list[Mount]:
    """``shared`` plus the workspace and its tmp (writable, each also at its own path, which is
    how the host names them to a command), parents first."""
    mounts = [("rw", t, str(tmp)) if kind == "tmp" else (kind, t, s) for kind, t, s in shared]
    mounts += [("rw", str(work), str(work)), ("rw", str(tmp), str(tmp))]
    return sorted(mounts, key=lambda m: len(Path(m[1]).parts))

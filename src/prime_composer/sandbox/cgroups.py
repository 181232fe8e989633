"""Whole-run limits with cgroups: memory of all the run's processes, their number, and CPU bandwidth.

rlimits are per process (``RLIMIT_AS``: 4 processes x 1.4 GiB held 5 GiB against a 2 GiB
limit); a cgroup holds the whole run. ``Cgroups.detect`` finds, from ``/proc/self/mountinfo``
and ``/proc/self/cgroup``, either a cgroup v2 hierarchy with the ``memory``, ``pids`` and ``cpu``
controllers, or the v1 hierarchies of each (the development machines mount v1 only). Each
``Sandbox`` makes one folder, ``prime-composer-sandbox-<pid>-<n>``, inside this process's own
cgroup (so whatever limits this process also holds its runs), and one folder per run inside it:

    v2  memory.max, memory.swap.max = 0   pids.max   cpu.max = "<quota> <period>"
    v1  memory.limit_in_bytes (+ memsw)   pids.max   cpu.cfs_quota_us / cpu.cfs_period_us

The run's top process (``_init.py``'s ``outer``) writes its pid into each ``cgroup.procs``
before it forks anything, so every process of the run is inside. After the run ``RunCgroup.
finish`` reads what the run hit (the kernel's OOM kills, refused forks, CPU throttling) and its
peak memory, waits for the last process to leave (the pid namespace's teardown) and removes the
folders; ``Cgroups.close`` removes the sandbox's folder, and ``sweep`` the folders of sandboxes
whose process died.

In v2 a cgroup that holds processes cannot give controllers to its children (the "no internal
processes" rule): this process must then run in a cgroup of its own leaf's parent (systemd's
``Delegate=yes`` does this). When no hierarchy offers a controller, the sandbox says so at
start and those limits fall back to rlimits (``RLIMIT_NPROC`` per uid; memory only per process).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

CONTROLLERS = ("memory", "pids", "cpu")
MOUNTINFO = Path("/proc/self/mountinfo")
SELF_CGROUP = Path("/proc/self/cgroup")
CPU_PERIOD_US = 100_000
_PREFIX = "prime-composer-sandbox-"
_counter = itertools.count()


@dataclass(frozen=True)
class RunLimits:
    """What one run's cgroup enforces; ``None`` leaves that resource unlimited."""

    memory_bytes: int | None
    max_tasks: int | None
    cpus: float | None


@dataclass
class RunUsage:
    """What a run's cgroup saw."""

    oom_kills: int = 0
    refused_forks: int = 0
    throttled_periods: int = 0
    peak_memory_bytes: int | None = None


def _read_int(path: Path, key: str | None = None) -> int:
    text = path.read_text()
    if key is None:
        return int(text.split()[0])
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


@dataclass
class RunCgroup:
    """One run's folders (one in v2, one per controller in v1)."""

    version: int
    dirs: dict[str, Path]
    """Controller -> folder (v2: the same folder for every controller)."""

    @property
    def procs_files(self) -> list[str]:
        return sorted({str(d / "cgroup.procs") for d in self.dirs.values()})

    def usage(self) -> RunUsage:
        usage = RunUsage()
        with contextlib.suppress(OSError, ValueError):
            if (memory := self.dirs.get("memory")) is not None:
                if self.version == 2:
                    usage.oom_kills = _read_int(memory / "memory.events", "oom_kill")
                    if (memory / "memory.peak").exists():
                        usage.peak_memory_bytes = _read_int(memory / "memory.peak")
                else:
                    usage.oom_kills = _read_int(memory / "memory.oom_control", "oom_kill")
                    usage.peak_memory_bytes = _read_int(memory / "memory.max_usage_in_bytes")
            if (pids := self.dirs.get("pids")) is not None:
                usage.refused_forks = _read_int(pids / "pids.events", "max")
            if (cpu := self.dirs.get("cpu")) is not None:
                usage.throttled_periods = _read_int(cpu / "cpu.stat", "nr_throttled")
        return usage

    def finish(self, timeout_s: float = 5.0) -> RunUsage:
        """What the run hit; then wait for its processes to be gone and remove the folders."""
        usage = self.usage()
        self.remove(timeout_s)
        return usage

    def remove(self, timeout_s: float = 5.0) -> bool:
        """Remove the folders once empty (the kernel may still be tearing the run down)."""
        deadline = time.monotonic() + timeout_s
        left = set(self.dirs.values())
        while left:
            for folder in sorted(left):
                try:
                    folder.rmdir()
                    left.discard(folder)
                except FileNotFoundError:
                    left.discard(folder)
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        raise
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        if left:
            logger.warning("sandbox: cgroup folders still busy after %.0f s: %s", timeout_s, sorted(left))
        return not left


@dataclass
class Cgroups:
    """Where this process's sandbox cgroups live, and which controllers they have."""

    version: int | None
    parents: dict[str, Path] = field(default_factory=dict)
    """Controller -> the folder holding this sandbox's run folders."""
    missing: dict[str, str] = field(default_factory=dict)
    """Controller -> why it is unavailable."""

    @classmethod
    def detect(cls) -> Cgroups:
        """The hierarchies of this process (v2 if it has every controller, else v1), ready for runs."""
        try:
            mounts = _cgroup_mounts(MOUNTINFO.read_text())
            own = _own_cgroups(SELF_CGROUP.read_text())
        except OSError as e:
            return cls(None, missing=dict.fromkeys(CONTROLLERS, f"cannot read {e.filename}: {e.strerror}"))
        name = f"{_PREFIX}{os.getpid()}-{next(_counter)}"
        v2 = cls._try_v2(mounts, own, name)
        if v2 is not None and not v2.missing:
            return v2
        v1 = cls._try_v1(mounts, own, name)
        if v2 is not None and len(v2.parents) > len(v1.parents):
            v1.close()
            return v2
        if v2 is not None:
            v2.close()
            if not v1.parents:
                v1.missing = {c: f"{v1.missing.get(c)}; v2: {v2.missing.get(c)}" for c in CONTROLLERS}
        return v1

    @classmethod
    def _try_v2(cls, mounts: dict[str, tuple[str, str]], own: dict[str, str], name: str) -> Cgroups | None:
        if "" not in mounts or "" not in own:
            return None
        mount_point, mount_root = mounts[""]
        base = _join(mount_point, mount_root, own[""])
        if base is None:
            return None
        result = cls(2)
        try:
            available = set((base / "cgroup.controllers").read_text().split())
        except OSError as e:
            return cls(2, missing=dict.fromkeys(CONTROLLERS, f"cgroup v2 at {base}: {e.strerror}"))
        wanted = [c for c in CONTROLLERS if c in available]
        for c in CONTROLLERS:
            if c not in available:
                result.missing[c] = f"cgroup v2 at {base} does not offer {c}"
        if not wanted:
            return result
        parent = base / name
        try:
            _enable(base, wanted)
            parent.mkdir()
            _enable(parent, wanted)
        except OSError as e:
            with contextlib.suppress(OSError):
                parent.rmdir()
            reason = (
                f"cannot delegate {', '.join(wanted)} below {base} ({e.strerror}); in cgroup v2 this "
                "process must not share its cgroup with controllers enabled (run it in a cgroup of its own)"
            )
            return cls(2, missing=dict.fromkeys(CONTROLLERS, reason))
        result.parents = dict.fromkeys(wanted, parent)
        return result

    @classmethod
    def _try_v1(cls, mounts: dict[str, tuple[str, str]], own: dict[str, str], name: str) -> Cgroups:
        result = cls(1)
        for controller in CONTROLLERS:
            if controller not in mounts or controller not in own:
                result.missing[controller] = f"no cgroup v1 hierarchy with {controller} is mounted"
                continue
            mount_point, mount_root = mounts[controller]
            base = _join(mount_point, mount_root, own[controller])
            if base is None:
                result.missing[controller] = f"this process's {controller} cgroup is outside {mount_point}"
                continue
            parent = base / name
            try:
                parent.mkdir(exist_ok=True)
            except OSError as e:
                result.missing[controller] = f"cannot create {parent}: {e.strerror}"
                continue
            result.parents[controller] = parent
        if not result.parents:
            result.version = None
        return result

    @property
    def available(self) -> bool:
        return bool(self.parents)

    def create(self, limits: RunLimits) -> RunCgroup:
        """A new run's folders with ``limits`` written; raises ``OSError`` if the kernel refuses."""
        assert self.version is not None
        name = f"run-{next(_counter)}"
        dirs: dict[str, Path] = {}
        try:
            for controller, parent in self.parents.items():
                folder = parent / name
                if folder not in dirs.values():
                    folder.mkdir()
                dirs[controller] = folder
            run = RunCgroup(self.version, dirs)
            _write_limits(run, limits)
        except BaseException:
            RunCgroup(self.version, dirs).remove(timeout_s=0)
            raise
        return run

    def sweep(self) -> int:
        """Remove folders of sandboxes whose process is gone (it crashed); how many."""
        removed = 0
        for parent in {p.parent for p in self.parents.values()}:
            for stale in parent.glob(f"{_PREFIX}*"):
                match = re.fullmatch(rf"{_PREFIX}(\d+)-\d+", stale.name)
                if match is None or _alive(int(match.group(1))):
                    continue
                for run in stale.iterdir():
                    if run.is_dir():
                        RunCgroup(self.version or 1, {"x": run}).remove(timeout_s=0)
                with contextlib.suppress(OSError):
                    stale.rmdir()
                    removed += 1
        return removed

    def close(self) -> None:
        for parent in set(self.parents.values()):
            with contextlib.suppress(FileNotFoundError):
                try:
                    parent.rmdir()
                except OSError as e:
                    logger.warning("sandbox: cannot remove cgroup folder %s: %s", parent, e.strerror)
        self.parents = {}


def _write_limits(run: RunCgroup, limits: RunLimits) -> None:
    memory, pids, cpu = (run.dirs.get(c) for c in CONTROLLERS)
    if run.version == 2:
        if memory is not None and limits.memory_bytes is not None:
            (memory / "memory.max").write_text(str(limits.memory_bytes))
            if (memory / "memory.swap.max").exists():
                (memory / "memory.swap.max").write_text("0")
        if pids is not None and limits.max_tasks is not None:
            (pids / "pids.max").write_text(str(limits.max_tasks))
        if cpu is not None and limits.cpus is not None:
            (cpu / "cpu.max").write_text(f"{max(1000, int(limits.cpus * CPU_PERIOD_US))} {CPU_PERIOD_US}")
        return
    if memory is not None and limits.memory_bytes is not None:
        (memory / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
        if (memory / "memory.memsw.limit_in_bytes").exists():  # memory + swap: no swapping past it
            (memory / "memory.memsw.limit_in_bytes").write_text(str(limits.memory_bytes))
    if pids is not None and limits.max_tasks is not None:
        (pids / "pids.max").write_text(str(limits.max_tasks))
    if cpu is not None and limits.cpus is not None:
        (cpu / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
        (cpu / "cpu.cfs_quota_us").write_text(str(max(1000, int(limits.cpus * CPU_PERIOD_US))))


def _enable(folder: Path, controllers: list[str]) -> None:
    current = set((folder / "cgroup.subtree_control").read_text().split())
    todo = [c for c in controllers if c not in current]
    if todo:
        (folder / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in todo))


def _cgroup_mounts(mountinfo: str) -> dict[str, tuple[str, str]]:
    """Controller (``""`` for v2) -> (mount point, root of the hierarchy shown there)."""
    found: dict[str, tuple[str, str]] = {}
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        root, mount_point = _unescape(fields[3]), _unescape(fields[4])
        if tail[0] == "cgroup2":
            found.setdefault("", (mount_point, root))
        elif tail[0] == "cgroup":
            for option in tail[2].split(","):
                if option in CONTROLLERS:
                    found.setdefault(option, (mount_point, root))
    return found


def _own_cgroups(text: str) -> dict[str, str]:
    """Controller (``""`` for v2) -> this process's cgroup path in that hierarchy."""
    own: dict[str, str] = {}
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            own[controller] = path
    return own


def _join(mount_point: str, mount_root: str, path: str) -> Path | None:
    if path != mount_root and not path.startswith(mount_root.rstrip("/") + "/"):
        return None
    relative = path[len(mount_root) :].lstrip("/")
    return Path(mount_point) / relative


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

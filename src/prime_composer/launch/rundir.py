"""Preparing ``<output_dir>`` before the processes start: fresh start or resume.

A fresh start must not mix with files of an earlier run (a trainer reading a stale
``rollouts/step_0``, a plot mixing two runs), so it clears them, and refuses to delete
checkpoints unless asked (``launch.overwrite``). A resume from step N keeps the checkpoints,
removes what the interrupted run produced for steps >= N (rollouts, newer weights, metric
lines, newer checkpoint steps), so every step is produced and logged exactly once.

Before either, the launcher locks the directory (``lock_run_dir``): one run per directory, so a
second ``rl`` on a live run's directory (with ``--launch.overwrite`` or without) refuses, naming
the running one, and deletes nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path

from prime_composer.checkpoint_layout import (
    DEFAULT_PARTS,
    ResumePoint,
    all_steps,
    complete_steps,
    find_resume_point,
    parse_step_dir,
    remove_step,
)
from prime_composer.config.errors import ConfigError
from prime_composer.io import atomic_write_text

TRANSIENT = ("rollouts", "broadcasts", "metrics", "logs", "report.png")


def prepare_fresh(output_dir: Path, overwrite: bool, extra: tuple[str, ...] = ()) -> None:
    checkpoints = output_dir / "checkpoints"
    if complete_steps(checkpoints) and not overwrite:
        raise ConfigError(
            f"output_dir = '{output_dir}' holds checkpoints of an earlier run: continue it with --resume, "
            f"or start over with --launch.overwrite (deletes it), or choose another output_dir"
        )
    for name in (*TRANSIENT, "checkpoints", *extra):
        path = output_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def prepare_resume(
    output_dir: Path, requested_step: int | None, parts: tuple[str, ...] = DEFAULT_PARTS
) -> ResumePoint:
    """Trim ``output_dir`` back to the newest complete checkpoint that verifies; returns it (with
    the newer ones it skipped and why)."""
    point = find_resume_point(output_dir / "checkpoints", requested_step, parts)
    step = point.step
    # Newer checkpoint steps are the interrupted run's future: parts the other process never
    # matched (a full disk), or steps that did not verify. The resumed run writes them again.
    for newer in all_steps(output_dir / "checkpoints"):
        if newer > step:
            remove_step(output_dir / "checkpoints", newer)
    for path in _step_dirs(output_dir / "rollouts"):
        if (parse_step_dir(path) or 0) >= step:
            shutil.rmtree(path)
    for path in _step_dirs(output_dir / "broadcasts"):
        if (parse_step_dir(path) or 0) > step:
            shutil.rmtree(path)
    for metrics in (output_dir / "metrics").glob("*.jsonl"):
        trim_metrics(metrics, before_step=step)
    return point


def trim_metrics(path: Path, before_step: int) -> None:
    """Keep the records of steps < ``before_step`` (the resumed run logs the rest again)."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] < before_step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    atomic_write_text(path, "".join(line + "\n" for line in kept))


def _step_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.is_dir() and parse_step_dir(p) is not None]


# ----------------------------------------------------------------------------- one run per directory

LOCK_NAME = ".rl.lock"
"""``<output_dir>/.rl.lock``: held (``flock``) by the launcher of the live run, naming it."""


class RunLock:
    """The lock of one run on its ``output_dir``, like git's index lock but released by the kernel
    when its holder dies: the file says who holds it (pid, host, start time, command), and an
    ``flock`` on it says whether that holder is still alive. A leftover file of a killed run is
    therefore stale by construction and simply taken over."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        """Give the directory up (the file stays, emptied: removing it could let two runs lock two
        different files of the same name)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        os.close(self._fd)  # closing the last descriptor releases the flock
        self._fd = None


def lock_run_dir(output_dir: Path, command: str = "") -> RunLock:
    """Take ``output_dir`` for this run, before anything in it is read or deleted.

    Raises ``ConfigError`` naming the live run (pid, host, start time, command) when another
    launcher holds it; a lock left by a run that died is taken over (said on stdout).
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        raise ConfigError(
            f"output_dir = '{output_dir}' is in use by a live run ({_describe(holder)}): wait for it to "
            "finish or stop it, or choose another output_dir (--launch.overwrite never deletes a live "
            "run's files)"
        ) from None
    previous = _read_holder(fd)
    if previous:
        print(f"rl: taking over the stale lock of a run that is gone ({_describe(previous)})", flush=True)
    holder = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": command,
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    os.fsync(fd)
    return RunLock(path, fd)


def _read_holder(fd: int) -> dict[str, object]:
    try:
        data = os.pread(fd, 1 << 16, 0)
        holder = json.loads(data) if data.strip() else {}
    except (OSError, ValueError):
        return {"unreadable": True}
    return holder if isinstance(holder, dict) else {"unreadable": True}


def _describe(holder: dict[str, object]) -> str:
    if not holder or "pid" not in holder:
        return "holder unknown: its lock file is empty or unreadable"
    text = f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"
    return text + (f": {holder['command']}" if holder.get("command") else "")

"""A child process the launcher owns: its own process group, its log file, and a clean stop.

Each child runs in a new session (process group), so the launcher can signal the whole tree
(torchrun and its ranks, a vLLM server and its workers) at once, and a Ctrl-C in the terminal
reaches only the launcher, which then stops the children in order. On Linux each child also
asks the kernel to send it SIGTERM if the launcher dies, so even a SIGKILLed launcher leaves no
orphans behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for children: runs between fork and exec and asks the kernel to SIGTERM the
    child when this process dies, even by SIGKILL (Linux only; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class ProcessSpec:
    """What to start and how the launcher treats it."""

    name: str
    argv: list[str]
    kind: Literal["job", "service"]
    """A ``job`` must finish (exit 0) for the run to succeed; a ``service`` runs until stopped."""
    health_url: str | None = None
    """Polled after start; processes started after this one wait until it answers 200."""
    env: dict[str, str] = field(default_factory=dict)


class ManagedProcess:
    def __init__(self, spec: ProcessSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                self.spec.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.spec.env},
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    def poll(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM the whole process group, then SIGKILL it after ``timeout_s``."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self._signal_group(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while self.popen.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        # The leader may be gone while children of its group linger (e.g. torchrun's ranks).
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=timeout_s)
        return self.popen.returncode

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self.popen is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def tail(self, num_lines: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                lines = f.read().decode(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(lines[-num_lines:])

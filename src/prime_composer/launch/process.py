"""A child process the launcher owns: its own process group, its log file, and a clean stop.

Each child runs in a new session (process group), so the launcher can signal the whole tree
(torchrun and its ranks, a vLLM server and its workers) at once, and a Ctrl-C in the terminal
reaches only the launcher, which then stops the children in order. On Linux each child also
asks the kernel to send it SIGTERM if the launcher dies, so even a SIGKILLed launcher leaves no
orphans behind (``process_group.py``, shared with the vLLM backend).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from prime_composer.process_group import die_with_parent, signal_group, stop_group


@dataclass
class ProcessSpec:
    """What to start and how the launcher treats it."""

    name: str
    argv: list[str]
    kind: Literal["job", "service"]
    """A ``job`` must finish (exit 0) for the run to succeed; a ``service`` runs until stopped."""
    health_url: str | None = None
    """Polled after start; the processes that wait for this one start once it answers 200."""
    env: dict[str, str] = field(default_factory=dict)
    group: str | None = None
    """Services of one group are replicas of each other (``inference-0``, ``inference-1``): one
    that exits is reported and the run goes on while another of the group runs."""
    waits_for: tuple[str, ...] | None = None
    """The services (names or groups, each with a ``health_url``) that must be healthy before this
    process starts; ``None``: every earlier process, in order (each healthy if it has a
    ``health_url``); ``()``: nothing, it starts at once."""
    starts_early: bool = False
    """Start at once and hold the process at its start gate (``start_gate.py``) until what it
    waits for is healthy: its setup (imports, environments, model) overlaps the services' start.
    For a process that calls ``wait_start_gate()`` before its first request."""


class ManagedProcess:
    def __init__(self, spec: ProcessSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.popen: subprocess.Popen[bytes] | None = None
        self._terminated = False

    @property
    def name(self) -> str:
        return self.spec.name

    def start(self, extra_env: dict[str, str] | None = None) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                self.spec.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.spec.env, **(extra_env or {})},
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    def poll(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def terminate(self) -> None:
        """SIGTERM the whole process group and return at once (``stop`` then waits): the launcher
        signals several processes before it waits for any, so they stop side by side."""
        if self.popen is not None and self.popen.poll() is None and not self._terminated:
            signal_group(self.popen.pid, signal.SIGTERM)
            self._terminated = True

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM the whole process group (unless ``terminate`` did: torchrun, say, takes a
        second SIGTERM as a reason to cut its own clean-up short), then SIGKILL what is left of
        the group after ``timeout_s``."""
        if self.popen is None:
            return None
        if not self._terminated:
            return stop_group(self.popen, timeout_s)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=timeout_s)
        signal_group(self.popen.pid, signal.SIGKILL)  # the leader may be gone while its children linger
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=timeout_s)
        return self.popen.returncode

    def tail(self, num_lines: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                lines = f.read().decode(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(lines[-num_lines:])

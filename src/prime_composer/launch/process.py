"""A child process the launcher owns: its own process group, its log file, and a clean stop.

Each child runs in a new session (process group), so the launcher can signal the whole tree
(torchrun and its ranks, a vLLM server and its workers) at once, and a Ctrl-C in the terminal
reaches only the launcher, which then stops the children in order. On Linux each child also
asks the kernel to send it SIGTERM if the launcher dies, so even a SIGKILLed launcher leaves no
orphans behind (``process_group.py``, shared with the vLLM backend).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from prime_composer.process_group import die_with_parent, stop_group


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
    group: str | None = None
    """Services of one group are replicas of each other (``inference-0``, ``inference-1``): one
    that exits is reported and the run goes on while another of the group runs."""


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
        return None if self.popen is None else stop_group(self.popen, timeout_s)

    def tail(self, num_lines: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                lines = f.read().decode(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(lines[-num_lines:])

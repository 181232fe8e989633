"""The sandbox and limits every part of the environment shares (corpus build, generation, grading,
episodes).

``open_sandbox`` is ``prime_composer.sandbox.Sandbox`` with three changes: the Python inside is
the test venv (``runs.test_python``: pytest only), pytest's plugin autoloading is off and hashing
is seeded, and more folders are hidden: the store (sdists, built projects, tasks with their
expected values) and the environment's ``corpus/`` folder (the CI projects' sources), plus
``hidden_paths``. On a machine with other checkouts of this repository, hide those too (the
corpus build's visibility scan refuses a project it can find).
"""

from __future__ import annotations

import glob
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from feature_deletion import runs
from feature_deletion.spec import CORPUS_DIR, Store
from prime_composer.config.sandbox import LimitsConfig, SandboxConfig
from prime_composer.sandbox import Sandbox

DEFAULT_HIDDEN = (Path("/opt"), Path("/srv"), Path("/mnt"), Path("/media"), Path("/var/cache"))
"""Hidden besides the sandbox's defaults; a Python environment under one of them is still exposed."""


class Limits(BaseModel):
    """Limits of the environment's sandboxed runs."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    test_timeout_s: float = Field(default=120.0, gt=0)
    """Wall-clock limit of one full test-suite run (grading, validation, the agent's run_tests)."""
    probe_timeout_s: float = Field(default=30.0, gt=0)
    """Wall-clock limit of one probe run."""
    scan_timeout_s: float = Field(default=600.0, gt=0)
    """Wall-clock limit of the corpus build's visibility scan."""
    memory_mb: int = Field(default=2048, ge=64)
    """Address space per sandboxed process (``RLIMIT_AS``) in MiB."""
    max_processes: int = Field(default=64, ge=4)
    """Processes and threads of one workspace's user at once."""

    def test(self) -> LimitsConfig:
        seconds = int(self.test_timeout_s) + 1
        return LimitsConfig(
            timeout_s=self.test_timeout_s,
            cpu_s=seconds,
            memory_mb=self.memory_mb,
            max_processes=self.max_processes,
        )

    def probe(self) -> LimitsConfig:
        seconds = int(self.probe_timeout_s) + 1
        return LimitsConfig(
            timeout_s=self.probe_timeout_s,
            cpu_s=seconds,
            memory_mb=self.memory_mb,
            max_processes=self.max_processes,
        )

    def scan(self) -> LimitsConfig:
        seconds = int(self.scan_timeout_s) + 1
        return LimitsConfig(
            timeout_s=self.scan_timeout_s, cpu_s=seconds, max_output_bytes=2**20, kill_output_bytes=16 * 2**20
        )


def open_sandbox(
    store: Store, hidden_paths: Sequence[Path] = (), base: SandboxConfig | None = None
) -> Sandbox:
    """The environment's sandbox (see the module docstring); close it when done."""
    python = runs.test_python(store)
    hidden = [store.root, CORPUS_DIR, *DEFAULT_HIDDEN, *other_site_packages(), *hidden_paths]
    return Sandbox(runs.sandbox_config(base or SandboxConfig(), python, hidden))


def other_site_packages() -> list[Path]:
    """Installed-package folders of the base interpreter and of the system's Pythons."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    found = [Path(sys.base_prefix) / "lib" / version / "site-packages"]
    for pattern in ("/usr/lib/python3*/*-packages", "/usr/local/lib/python3*/*-packages"):
        found += [Path(p) for p in glob.glob(pattern)]
    return [p for p in found if p.is_dir()]

"""Test-wide settings: offline, quiet, and small thread counts for 2-core machines; the files that
hold slow tests are handed to the xdist workers first."""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files that hold a ``slow`` test first (in collection order: end-to-end, faults,
    integration), then the rest, the files with the most tests first.

    With ``--dist loadfile`` each xdist worker takes the next whole file when it is free, so the
    suite ends when the last long file ends: the long ones must start first and the short ones
    fill the end. xdist's own reordering (by the number of tests in a file, turned off by
    ``--no-loadscope-reorder`` in the pytest settings) put the one-test end-to-end files, the
    longest of all, last. Within a file the order is kept (its module fixtures are built once).
    """
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def key(entry: tuple[int, list[pytest.Item]]) -> tuple[int, int]:
        index, file_items = entry
        if any(item.get_closest_marker("slow") for item in file_items):
            return (0, index)
        return (1, -len(file_items))

    ordered = sorted(enumerate(files.values()), key=key)  # stable: ties keep collection order
    items[:] = [item for _, file_items in ordered for item in file_items]


def _shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This test run's temporary root, shared by the xdist workers (each has its own basetemp
    below it); never the repository or $HOME."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def warmed_model(tmp_path_factory: pytest.TempPathFactory, config: str, *overrides: str) -> Path:
    """The SFT warm-up of ``rl @ configs/<config> <overrides>`` (its model folder), trained once per
    test run by whichever worker asks first and shared, keyed by a digest of the config file and
    the overrides. For tests that need a warmed-up model but do not test the warm-up (the
    quickstart's end-to-end test runs its own)."""
    repo = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256(
        "\0".join([(repo / "configs" / config).read_text(), config, *overrides]).encode()
    ).hexdigest()[:16]
    root = _shared_root(tmp_path_factory) / f"warmup-{digest}"
    root.mkdir(exist_ok=True)
    final = root / "run" / "sft" / "final"
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker waits for the same warm-up
        if not (root / "done").exists():
            command = [sys.executable, "-m", "prime_composer.launch.rl", "@", str(repo / "configs" / config)]
            command += [
                "--output-dir",
                str(root / "run"),
                "--no-launch.progress",
                *overrides,
                "--warmup.only",
            ]
            proc = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=900)
            assert proc.returncode == 0 and (final / "config.json").is_file(), proc.stdout + proc.stderr
            (root / "done").touch()
    return final


@pytest.fixture(scope="session")
def quickstart_warmup(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quickstart's warm-up as the end-to-end tests shrink it (20 steps on 320 examples)."""
    return warmed_model(
        tmp_path_factory, "quickstart.toml", "--warmup.max-steps", "20", "--warmup.num-examples", "320"
    )

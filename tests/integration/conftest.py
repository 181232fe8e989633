"""Integration fixtures shared across files: the 2-rank FSDP2 workers, launched once per test run."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

WORKERS = Path(__file__).with_name("two_rank_workers.py")


@pytest.fixture(scope="session")
def two_rank_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``two_rank_runs(part)``: the folder that ``two_rank_workers.py``'s ``part`` wrote, from one
    ``torchrun`` of 2 ranks for every part, run by whichever xdist worker asks first (the other
    waits on the lock and reads the same folders). Fails the asking test with the launch's output
    if that part did not finish or the launch did not exit with 0."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "two-rank-workers"
    root.mkdir(exist_ok=True)
    log = root / "launch.log"
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not log.exists():
            env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_VERBOSITY": "error",
            }
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
            try:
                result = subprocess.run(
                    [*cmd, str(WORKERS), str(root)], env=env, capture_output=True, text=True, timeout=540
                )
                text = f"exit code {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            except subprocess.TimeoutExpired as e:
                text = f"timed out after {e.timeout} s"
            log.write_text(text)

    def part(name: str) -> Path:
        out = root / name
        if not (out / "done").exists():
            errors = "".join(p.read_text() for p in sorted(out.glob("error-rank*.txt")))
            pytest.fail(f"two_rank_workers.py part {name!r} did not finish:\n{errors}\n{log.read_text()}")
        # Every part's test also needs the launch to have ended cleanly (as its own torchrun had
        # to): a rank that aborts at exit after writing its results still fails them.
        assert log.read_text().startswith("exit code 0\n"), log.read_text()
        return out

    return part

"""Two runs on one directory: a second ``rl`` on a live run's ``output_dir`` (with
``--launch.overwrite`` or without) refuses in one line naming the running one, and deletes none of
its files (it used to delete the live run's rollouts, metrics and logs, which killed it)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "e2e_launch_helpers", Path(__file__).resolve().parents[1] / "e2e" / "conftest.py"
)
assert _spec is not None and _spec.loader is not None
_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_helpers)

HOLDER = """
import sys, time
from pathlib import Path
from prime_composer.launch.rundir import lock_run_dir
lock = lock_run_dir(Path(sys.argv[1]), command="uv run rl @ configs/quickstart.toml")
print("locked", flush=True)
time.sleep(600)
"""
LIVE_FILES = ("metrics/trainer.jsonl", "logs/trainer.log", "rollouts/step_0/rank_0.bin", "report.png")


@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
def test_a_second_rl_on_a_live_run_refuses_and_deletes_nothing(tmp_path: Path, overwrite: bool) -> None:
    # The first run: a real launcher lock held by a live process, and the files a run has written.
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        for name in LIVE_FILES:
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text(f"live {name}\n")
        extra = ["--launch.overwrite"] if overwrite else []
        proc = _helpers.run_rl(tmp_path, "--max-steps", "2", "--no-warmup.enabled", *extra, timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2, out[-2000:]
        assert f"in use by a live run (pid {holder.pid} on " in out and "quickstart.toml" in out, out[-2000:]
        assert "Traceback" not in out
        lost = [
            name
            for name in LIVE_FILES
            if not (tmp_path / name).is_file() or (tmp_path / name).read_text() != f"live {name}\n"
        ]
        assert not lost, f"the second run deleted the live run's {lost}: the fault was accepted"
    finally:
        holder.kill()
        holder.wait()

"""Preparing the run directory: a fresh start never mixes runs; a resume trims back to step N."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prime_composer.checkpoint_layout import StepCheckpoints, step_dir
from prime_composer.config.errors import ConfigError
from prime_composer.launch.rundir import LOCK_NAME, lock_run_dir, prepare_fresh, prepare_resume


def complete_checkpoint(out: Path, step: int) -> None:
    steps = StepCheckpoints(out / "checkpoints", keep=10)
    for part in ("trainer", "orchestrator"):
        steps.write_part(
            step,
            part,
            lambda tmp, p=part: (tmp / "state.json").write_text(json.dumps({"part": p, "step": step})),
        )


def test_fresh_start_refuses_to_delete_checkpoints_without_overwrite(tmp_path: Path) -> None:
    complete_checkpoint(tmp_path, 4)
    with pytest.raises(ConfigError, match=r"--resume.*--launch.overwrite"):
        prepare_fresh(tmp_path, overwrite=False)
    assert (tmp_path / "checkpoints").exists()
    (tmp_path / "rollouts" / "step_0").mkdir(parents=True)
    (tmp_path / "report.png").write_bytes(b"x")
    prepare_fresh(tmp_path, overwrite=True)
    assert not any((tmp_path / name).exists() for name in ("checkpoints", "rollouts", "report.png"))


def test_fresh_start_without_checkpoints_clears_transient_files(tmp_path: Path) -> None:
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "trainer.jsonl").write_text('{"step": 0}\n')
    prepare_fresh(tmp_path, overwrite=False)
    assert not (tmp_path / "metrics").exists()


def test_resume_trims_everything_produced_after_the_checkpoint(tmp_path: Path) -> None:
    complete_checkpoint(tmp_path, 2)
    complete_checkpoint(tmp_path, 4)
    (step_dir(tmp_path / "checkpoints", 6) / "trainer").mkdir(parents=True)  # incomplete: ignored
    for step in range(7):
        (tmp_path / "rollouts" / f"step_{step}").mkdir(parents=True)
        (tmp_path / "broadcasts" / f"step_{step}").mkdir(parents=True)
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "trainer.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": s}) + "\n" for s in range(6)) + '{"step": 6, "lo'
    )
    point = prepare_resume(tmp_path, None)
    assert (point.step, point.skipped) == (4, [])
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == [f"step_{s}" for s in range(4)]
    # Weights of step 4 itself stay (the trainer republishes them anyway); newer ones go.
    assert sorted(p.name for p in (tmp_path / "broadcasts").iterdir()) == [f"step_{s}" for s in range(5)]
    steps = [
        json.loads(line)["step"] for line in (tmp_path / "metrics" / "trainer.jsonl").read_text().splitlines()
    ]
    assert steps == [0, 1, 2, 3]


def test_resume_from_an_explicit_step_or_nothing(tmp_path: Path) -> None:
    complete_checkpoint(tmp_path, 2)
    complete_checkpoint(tmp_path, 4)
    assert prepare_resume(tmp_path, 2).step == 2
    with pytest.raises(ConfigError, match="resume_step = 3"):
        prepare_resume(tmp_path, 3)
    with pytest.raises(ConfigError, match="no complete, intact checkpoint"):
        prepare_resume(tmp_path / "elsewhere", None)


def test_resume_falls_back_past_a_damaged_checkpoint_and_says_why(tmp_path: Path) -> None:
    complete_checkpoint(tmp_path, 2)
    complete_checkpoint(tmp_path, 4)
    complete_checkpoint(tmp_path, 6)
    state = step_dir(tmp_path / "checkpoints", 6) / "orchestrator" / "state.json"
    state.write_text(state.read_text().replace("6", "9"))  # same size, other contents
    (step_dir(tmp_path / "checkpoints", 4) / "trainer" / "state.json").unlink()
    # Asking for the damaged step by name is an error that names the file, not a fallback.
    with pytest.raises(ConfigError, match=r"resume_step = 6.*state\.json.*corrupted"):
        prepare_resume(tmp_path, 6)
    point = prepare_resume(tmp_path, None)
    assert point.step == 2
    assert [s for s, _ in point.skipped] == [6, 4]
    assert "orchestrator/state.json" in point.skipped[0][1] and "corrupted" in point.skipped[0][1]
    assert "trainer/state.json" in point.skipped[1][1] and "missing" in point.skipped[1][1]
    # The newer steps belong to the abandoned run: gone, so the resumed run writes them afresh.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2"]


def test_resume_drops_newer_steps_that_hold_one_part_only(tmp_path: Path) -> None:
    """A full disk stopped the trainer's part of step 4 while the orchestrator wrote steps 4 and 6."""
    complete_checkpoint(tmp_path, 2)
    steps = StepCheckpoints(tmp_path / "checkpoints", keep=2)
    for step in (4, 6):
        steps.write_part(step, "orchestrator", lambda tmp: (tmp / "state.json").write_text("{}"))
    assert prepare_resume(tmp_path, None).step == 2
    assert not step_dir(tmp_path / "checkpoints", 4).exists()
    assert not step_dir(tmp_path / "checkpoints", 6).exists()


HOLDER = """
import sys, time
from pathlib import Path
from prime_composer.launch.rundir import lock_run_dir
lock = lock_run_dir(Path(sys.argv[1]), command="uv run rl @ first.toml")
print("locked", flush=True)
time.sleep(600)
"""


def _hold(output_dir: Path) -> subprocess.Popen[str]:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(output_dir)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    return holder


def test_a_second_run_on_a_live_run_dir_is_refused_naming_the_first(tmp_path: Path) -> None:
    holder = _hold(tmp_path)
    try:
        with pytest.raises(ConfigError, match=rf"in use by a live run \(pid {holder.pid} on .*first\.toml"):
            lock_run_dir(tmp_path)
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_of_a_run_that_died_is_taken_over(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    holder = _hold(tmp_path)
    holder.kill()  # SIGKILL: no chance to release
    holder.wait()
    lock = lock_run_dir(tmp_path, command="second")
    assert f"stale lock of a run that is gone (pid {holder.pid}" in capsys.readouterr().out
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    lock_run_dir(tmp_path).release()  # released: free again, and an emptied lock is not "stale"
    assert "stale" not in capsys.readouterr().out

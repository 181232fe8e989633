"""Preparing the run directory: a fresh start never mixes runs; a resume trims back to step N."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prime_composer.checkpoint_layout import StepCheckpoints, step_dir
from prime_composer.config.errors import ConfigError
from prime_composer.launch.rundir import prepare_fresh, prepare_resume


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

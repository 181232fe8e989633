"""The trainer run alone (``uv run trainer ...``) on a damaged batch: one line, no traceback.

Under ``rl`` the launcher reports a failed process; run alone, the trainer itself must say which
file is damaged and what to do, and exit non-zero without a Python traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from prime_composer.config.cli import run_entry_point
from prime_composer.config.errors import DAMAGED_INPUT_EXIT_CODE
from prime_composer.config.trainer import TrainerConfig
from prime_composer.transport.batch import BatchFormatError
from prime_composer.transport.filesystem import rank_path


def test_a_damaged_batch_is_one_line_naming_the_file(tmp_path: Path) -> None:
    batch = rank_path(tmp_path, 0, 0)
    batch.parent.mkdir(parents=True)
    batch.write_bytes(b"not a batch" * 8)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "prime_composer.trainer.main",
            "--output-dir",
            str(tmp_path),
            "--model.name",
            "builtin:tiny-qwen3",
            "--max-steps",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == DAMAGED_INPUT_EXIT_CODE, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("trainer: error:")]
    assert len(errors) == 1, done.stderr
    assert str(batch) in errors[0] and "--resume" in errors[0]


def test_a_batch_of_another_format_is_reported_the_same_way(capsys: pytest.CaptureFixture[str]) -> None:
    def main(config: TrainerConfig) -> int:
        raise BatchFormatError("rollouts/step_3/rank_0.bin: format version 9, this trainer reads 1")

    code = run_entry_point(TrainerConfig, main, prog="trainer", env_prefix="X_", argv=[])
    assert code == DAMAGED_INPUT_EXIT_CODE
    err = capsys.readouterr().err
    assert err.strip() == "trainer: error: rollouts/step_3/rank_0.bin: format version 9, this trainer reads 1"

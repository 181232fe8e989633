"""The trainer run alone (``uv run trainer ...``) on a damaged batch: one line, no traceback.

Under ``rl`` the launcher reports a failed process; run alone, the trainer itself must say which
file is damaged and what to do, and exit non-zero without a Python traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prime_composer.config.cli import run_entry_point
from prime_composer.config.errors import DAMAGED_INPUT_EXIT_CODE
from prime_composer.config.trainer import TrainerConfig
from prime_composer.config.transport import TransportConfig
from prime_composer.transport.batch import BatchFormatError, MicroBatch, encode_rank_batch
from prime_composer.transport.filesystem import FilesystemReceiver, rank_path


def a_batch(step: int) -> bytes:
    """A valid one-row batch of ``step`` for rank 0 (what the orchestrator writes)."""
    mb = MicroBatch(
        input_ids=torch.tensor([[5, 6, 7, 8]]),
        position_ids=torch.tensor([[0, 1, 2, 3]]),
        loss_mask=torch.tensor([[False, False, True, True]]),
        advantages=torch.tensor([[0.0, 0.0, 1.0, 1.0]]),
        inference_logprobs=torch.tensor([[0.0, 0.0, -1.0, -2.0]]),
        sample_ids=torch.zeros(1, 4, dtype=torch.long),
    )
    return encode_rank_batch(step, 0, [mb])


@pytest.mark.slow
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


@pytest.mark.slow  # a trainer process: ~20 s quiet, over a minute on a loaded 2-core machine
def test_a_truncated_batch_through_the_trainer_command_is_one_line(tmp_path: Path) -> None:
    """``uv run trainer``, the installed command, on a real batch cut short (a disk that filled)."""
    batch = rank_path(tmp_path, 0, 0)
    batch.parent.mkdir(parents=True)
    data = a_batch(0)
    batch.write_bytes(data[: len(data) - 17])
    command = Path(sys.executable).parent / "trainer"
    done = subprocess.run(
        [
            str(command),
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
    assert str(batch) in errors[0] and "truncated or corrupted" in errors[0] and "--resume" in errors[0]


def damage_flip(path: Path) -> None:
    data = bytearray(a_batch(0))
    data[-3] ^= 0x40  # a byte of the tensors' data
    path.write_bytes(bytes(data))


def damage_other_step(path: Path) -> None:
    path.write_bytes(a_batch(5))  # intact, but of another step


def damage_directory(path: Path) -> None:
    path.mkdir()


@pytest.mark.parametrize(
    "damage",
    [damage_flip, damage_other_step, damage_directory],
    ids=["flipped-byte", "other-step", "directory"],
)
def test_every_kind_of_bad_batch_file_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage
) -> None:
    """The trainer's read of a batch under its entry point: each damage is one error line naming
    the file (a wrong step and a directory in the file's place were tracebacks)."""
    batch = rank_path(tmp_path, 0, 0)
    batch.parent.mkdir(parents=True)
    damage(batch)

    def main(config: TrainerConfig) -> int:
        FilesystemReceiver(tmp_path, TransportConfig()).receive(0, 0)
        return 0

    code = run_entry_point(TrainerConfig, main, prog="trainer", env_prefix="X_", argv=[])
    err = capsys.readouterr().err
    assert code == DAMAGED_INPUT_EXIT_CODE, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"trainer: error: {batch}: "), err
    assert "--resume" in lines[0]

"""The ``diloco`` checkpoint part goes through the one part writer (``StepCheckpoints.write_part``):
atomic, with its manifest and marker, verified on read, committed with the step's other parts by
the trainer; a full disk leaves no partial files and the committed steps intact."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from prime_composer.checkpoint_layout import (
    CheckpointWriteError,
    StepCheckpoints,
    is_committed,
    marker_path,
    part_is_written,
    step_dir,
)
from prime_composer.diloco.part import CHECKPOINT_PART, read_part, write_part
from prime_composer.integrity import IntegrityError


def _state(n: int = 10) -> dict[str, object]:
    torch.manual_seed(0)
    return {"theta.0": torch.randn(n), "momentum.0": torch.randn(n)[::2], "num_updates": 3, "round": [1, 2]}


def _trainer_part(root: Path, step: int) -> None:
    parts = ("trainer", CHECKPOINT_PART)
    StepCheckpoints(root, keep=2, parts=parts).write_part(
        step, "trainer", lambda tmp: (tmp / "w.bin").write_bytes(b"w"), commit=False
    )


def test_the_part_round_trips_bit_for_bit_and_waits_for_the_trainer_to_commit(tmp_path: Path) -> None:
    state = _state()
    _trainer_part(tmp_path, 4)
    final = write_part(tmp_path, 4, state)
    assert final == step_dir(tmp_path, 4) / CHECKPOINT_PART and part_is_written(tmp_path, 4, CHECKPOINT_PART)
    assert sorted(p.name for p in final.iterdir()) == ["MANIFEST.json", "meta.json", "state.safetensors"]
    assert not (step_dir(tmp_path, 4) / f".{CHECKPOINT_PART}.tmp").exists()
    assert json.loads(marker_path(tmp_path, 4, CHECKPOINT_PART).read_text())["parts"] == [CHECKPOINT_PART]
    assert not is_committed(tmp_path, 4)  # the trainer commits (with its ckpt.keep)
    assert StepCheckpoints(tmp_path, keep=2, parts=("trainer", CHECKPOINT_PART)).commit(4)
    loaded = read_part(tmp_path, 4)
    assert loaded["num_updates"] == 3 and loaded["round"] == [1, 2] and loaded["step"] == 4
    for key in ("theta.0", "momentum.0"):
        assert torch.equal(loaded[key], state[key])  # type: ignore[arg-type]


def test_rewriting_a_committed_part_uncommits_the_step_first(tmp_path: Path) -> None:
    _trainer_part(tmp_path, 2)
    write_part(tmp_path, 2, _state())
    steps = StepCheckpoints(tmp_path, keep=2, parts=("trainer", CHECKPOINT_PART))
    assert steps.commit(2)
    write_part(tmp_path, 2, _state(12))
    assert not is_committed(tmp_path, 2) and read_part(tmp_path, 2)["theta.0"].numel() == 12


def test_a_damaged_part_is_refused_on_read(tmp_path: Path) -> None:
    final = write_part(tmp_path, 1, _state())
    data = bytearray((final / "state.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (final / "state.safetensors").write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"state\.safetensors"):
        read_part(tmp_path, 1)


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a 256 KiB tmpfs")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_leaves_no_partial_part_and_the_committed_step_intact(tiny_disk: Path) -> None:
    _trainer_part(tiny_disk, 1)
    write_part(tiny_disk, 1, _state())
    assert StepCheckpoints(tiny_disk, keep=2, parts=("trainer", CHECKPOINT_PART)).commit(1)
    with pytest.raises(CheckpointWriteError, match=r"No space left.*newest complete checkpoint is step 1"):
        write_part(tiny_disk, 2, _state(200_000))  # 1.2 MB of float32: more than the disk holds
    assert not (step_dir(tiny_disk, 2) / f".{CHECKPOINT_PART}.tmp").exists()
    assert not part_is_written(tiny_disk, 2, CHECKPOINT_PART)
    assert is_committed(tiny_disk, 1) and read_part(tiny_disk, 1)["num_updates"] == 3

"""Damaged checkpoints, one scenario per test: a truncated, bit-flipped, zeroed or missing file of
every kind in a trainer or orchestrator checkpoint part, and a full disk while writing one.

Each asserts the three things a user needs: the damage is refused with a message naming the file
(never different weights loaded silently), ``--resume`` falls back to the newest checkpoint that is
intact and says why it skipped the damaged one, and that older checkpoint restores exactly what
was saved (nothing lost). The expected weights are copies taken before saving, not read back
through the code under test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prime_composer.checkpoint_layout import find_resume_point, step_dir
from prime_composer.config.errors import ConfigError
from prime_composer.config.optim import OptimConfig
from prime_composer.integrity import IntegrityError
from prime_composer.orchestrator.state import OrchestratorState
from prime_composer.trainer.checkpoint import CheckpointManager
from prime_composer.trainer.model import World
from prime_composer.trainer.optim import build_optimizer

WORLD = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    optimizer, scheduler = build_optimizer(model, OptimConfig(lr=1e-2), max_steps=10)
    return model, optimizer, scheduler


def _train_one_step(model, optimizer, scheduler) -> None:
    model(torch.randn(4, 64)).square().mean().backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def _save_two(root: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Checkpoints of steps 1 and 2 (both parts); returns the weights each should restore."""
    model, optimizer, scheduler = _model()
    manager = CheckpointManager(root, keep=5, world=WORLD)
    expected = {}
    for step in (1, 2):
        _train_one_step(model, optimizer, scheduler)
        expected[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        manager.save(step, model, optimizer, scheduler)
        OrchestratorState(step=step, groups_drawn=4 * step, env_draws=[4 * step]).save(root, keep=5)
    return expected


def _files(root: Path, step: int, part: str) -> list[Path]:
    directory = step_dir(root, step) / part
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != "MANIFEST.json")


def _largest(files: list[Path]) -> Path:
    return max(files, key=lambda p: p.stat().st_size)


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def zero_block(path: Path) -> None:
    data = bytearray(path.read_bytes())
    start = len(data) // 4
    data[start : start + min(59_000, len(data) // 2)] = bytes(min(59_000, len(data) // 2))
    path.write_bytes(bytes(data))


def delete(path: Path) -> None:
    path.unlink()


DAMAGE = {"truncated": truncate, "bit-flipped": flip_bit, "zeroed": zero_block, "deleted": delete}
KINDS = {
    # (part, how to pick the file)
    "weight-shard": ("trainer", lambda files: _largest([f for f in files if f.suffix == ".distcp"])),
    "dcp-metadata": ("trainer", lambda files: next(f for f in files if f.name == ".metadata")),
    "scheduler": ("trainer", lambda files: next(f for f in files if f.name == "scheduler.pt")),
    "rng-state": ("trainer", lambda files: next(f for f in files if f.parent.name == "rng")),
    "trainer-meta": ("trainer", lambda files: next(f for f in files if f.name == "meta.json")),
    "orchestrator-state": ("orchestrator", lambda files: next(f for f in files if f.name == "state.json")),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("kind", list(KINDS))
def test_damaged_checkpoint_file_is_refused_and_resume_falls_back(
    tmp_path: Path, kind: str, damage: str
) -> None:
    torch.set_num_threads(1)
    expected = _save_two(tmp_path)
    part, pick = KINDS[kind]
    target = pick(_files(tmp_path, 2, part))
    DAMAGE[damage](target)

    point = find_resume_point(tmp_path, None)
    assert point.step == 1, "resumed from the damaged checkpoint"
    assert [s for s, _ in point.skipped] == [2]
    assert target.name in point.skipped[0][1]
    with pytest.raises(ConfigError, match=target.name):  # asking for it by name is an error
        find_resume_point(tmp_path, 2)
    if part == "trainer":
        with pytest.raises(IntegrityError, match=target.name):
            CheckpointManager(tmp_path, keep=5, world=WORLD).load(2, *_model())
    else:
        with pytest.raises(IntegrityError, match=target.name):
            OrchestratorState.load(tmp_path, 2)
    # The intact checkpoint restores exactly what was saved.
    model, optimizer, scheduler = _model()
    CheckpointManager(tmp_path, keep=5, world=WORLD).load(point.step, model, optimizer, scheduler)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[1][name]), name
    assert OrchestratorState.load(tmp_path, 1) == OrchestratorState(step=1, groups_drawn=4, env_draws=[4])


def test_a_missing_manifest_is_not_trusted(tmp_path: Path) -> None:
    _save_two(tmp_path)
    (step_dir(tmp_path, 2) / "trainer" / "MANIFEST.json").unlink()
    point = find_resume_point(tmp_path, None)
    assert point.step == 1 and "MANIFEST.json" in point.skipped[0][1]


def _mount_tmpfs(where: Path, size: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    where.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)]).returncode == 0


FULL_DISK_CHILD = """
import resource, signal, sys, torch
sys.path.insert(0, {tests!r})
import test_checkpoint_faults as t
model, optimizer, scheduler = t._model()
manager = t.CheckpointManager({root!r}, keep=5, world=t.WORLD)
t._train_one_step(model, optimizer, scheduler)
manager.save(1, model, optimizer, scheduler)
torch.save({{k: v.clone() for k, v in model.state_dict().items()}}, {expected!r})
if {limit}:  # no tmpfs to fill: cap the size of any file this process writes instead
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
t._train_one_step(model, optimizer, scheduler)
try:
    manager.save(2, model, optimizer, scheduler)
except OSError as e:
    print("SAVE FAILED:", e)
"""


@pytest.mark.slow
def test_a_full_disk_while_writing_a_checkpoint_loses_nothing(tmp_path: Path) -> None:
    """The second checkpoint does not fit: the save fails with a message naming the checkpoint that
    is intact, leaves no partial files, and the first one still verifies and loads."""
    root = tmp_path / "disk"
    mounted = _mount_tmpfs(root, "768k")  # room for one checkpoint (~0.5 MB) but not two
    try:
        limit = 0 if mounted else 100_000  # without root: the same failure through RLIMIT_FSIZE
        code = FULL_DISK_CHILD.format(
            tests=str(Path(__file__).parent),
            root=str(root),
            expected=str(tmp_path / "expected.pt"),
            limit=limit,
        )
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "SAVE FAILED" in proc.stdout, "the disk never filled up: the scenario did not happen"
        message = proc.stdout.split("SAVE FAILED:", 1)[1]
        assert (
            "checkpoint of step 2 could not be written" in message
            and "newest complete checkpoint is step 1" in message
        )
        assert not (step_dir(root, 2) / ".trainer.tmp").exists()  # no partial files left
        assert not (step_dir(root, 2) / "trainer").exists()
        point = find_resume_point(root, None, parts=("trainer",))
        assert point.step == 1 and point.skipped == []
        model, optimizer, scheduler = _model()
        CheckpointManager(root, keep=5, world=WORLD).load(1, model, optimizer, scheduler)
        expected = torch.load(tmp_path / "expected.pt")
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, expected[name]), name
    finally:
        if mounted:
            subprocess.run(["umount", str(root)])

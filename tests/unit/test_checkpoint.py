"""Checkpoints: bit-exact resume on the tiny model, atomicity markers, retention, clear errors."""

from __future__ import annotations

import json
import random

import pytest
import torch
from torch import nn

from prime_composer.checkpoint_layout import all_steps, find_resume_point, is_complete, step_marker_path
from prime_composer.config.base import ModelConfig
from prime_composer.config.optim import OptimConfig
from prime_composer.orchestrator.state import OrchestratorState
from prime_composer.trainer.checkpoint import (
    CheckpointManager,
    CheckpointWriteError,
    complete_steps,
    latest_complete_step,
    marker_path,
    step_dir,
)
from prime_composer.trainer.model import World, load_model
from prime_composer.trainer.optim import build_optimizer, clip_grad_norm

WORLD = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
OPTIM = OptimConfig(lr=1e-3, weight_decay=0.1, warmup_steps=1, schedule="cosine", min_lr_ratio=0.1)
MAX_STEPS = 4


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    model, _ = load_model(ModelConfig(name="builtin:tiny-qwen3", dtype="float32"), torch.device("cpu"))
    optimizer, scheduler = build_optimizer(model, OPTIM, MAX_STEPS)
    return model, optimizer, scheduler


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> None:
    # The batch comes from the global torch RNG, and a python-RNG draw picks its length, so the
    # run only matches an uninterrupted one if the checkpoint restored both generators.
    length = random.randint(8, 16)
    ids = torch.randint(0, model.config.vocab_size, (4, length))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    clip_grad_norm(model, 0.5)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)


def test_resume_is_bit_exact(tmp_path):
    torch.set_num_threads(1)  # same kernels and reduction order in both runs
    _seed(0)
    model_a, opt_a, sched_a = _fresh()
    for _ in range(MAX_STEPS):
        _train_step(model_a, opt_a, sched_a)
    draws_a = (torch.rand(3), random.random())

    _seed(0)
    model_b, opt_b, sched_b = _fresh()
    for _ in range(2):
        _train_step(model_b, opt_b, sched_b)
    manager = CheckpointManager(tmp_path, keep=2, world=WORLD)
    manager.save(2, model_b, opt_b, sched_b, extra={"samples_seen": 8, "note": "x"})
    del model_b, opt_b, sched_b

    _seed(1234)  # scramble every generator: load must restore them
    model_c, opt_c, sched_c = _fresh()
    extra = manager.load(None, model_c, opt_c, sched_c)
    assert extra == {"samples_seen": 8, "note": "x"}
    assert sched_c.last_epoch == 2
    for _ in range(2):
        _train_step(model_c, opt_c, sched_c)
    draws_c = (torch.rand(3), random.random())

    params_a = dict(model_a.named_parameters())
    for name, param in model_c.named_parameters():
        assert torch.equal(param, params_a[name]), name
    assert sched_c.get_last_lr() == sched_a.get_last_lr()
    state_a, state_c = opt_a.state_dict()["state"], opt_c.state_dict()["state"]
    assert state_a.keys() == state_c.keys()
    for key in state_a:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state_a[key][name], state_c[key][name]), (key, name)
    assert torch.equal(draws_a[0], draws_c[0]) and draws_a[1] == draws_c[1]


def _linear() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    model = nn.Linear(3, 2)
    optimizer, scheduler = build_optimizer(model, OptimConfig(), max_steps=10)
    return model, optimizer, scheduler


def test_marker_written_last_and_incomplete_never_loaded(tmp_path):
    manager = CheckpointManager(tmp_path, keep=5, world=WORLD)
    model, optimizer, scheduler = _linear()
    manager.save(2, model, optimizer, scheduler)
    assert marker_path(tmp_path, 2, "trainer").is_file()
    assert sorted(p.name for p in (step_dir(tmp_path, 2) / "trainer").iterdir()) == [
        "MANIFEST.json",
        "meta.json",
        "model_optim",
        "rng",
        "scheduler.pt",
    ]
    # A newer step whose save crashed before the marker: files there, no trainer.STABLE.
    manager.save(4, model, optimizer, scheduler)
    marker_path(tmp_path, 4, "trainer").unlink()
    # And one that crashed while still in its temporary directory.
    (step_dir(tmp_path, 6) / ".trainer.tmp").mkdir(parents=True)

    assert latest_complete_step(tmp_path) == 2
    assert manager.resolve_step(None) == 2
    with pytest.raises(
        ValueError, match=r"step 4 .*complete steps: 2.*incomplete checkpoint is never loaded"
    ):
        manager.load(4, *_linear())
    fresh = _linear()
    manager.load(None, *fresh)
    assert torch.equal(fresh[0].weight, model.weight)


def test_no_checkpoint_is_a_clear_error(tmp_path):
    manager = CheckpointManager(tmp_path / "none", keep=1, world=WORLD)
    with pytest.raises(ValueError, match=r"no complete trainer checkpoint under .*none"):
        manager.load(None, *_linear())


def test_a_step_is_complete_only_with_every_part_and_steps_are_pruned_together(tmp_path):
    parts = ("trainer", "orchestrator")
    manager = CheckpointManager(tmp_path, keep=2, world=WORLD, parts=parts)
    model, optimizer, scheduler = _linear()
    for step in (1, 2, 3, 4):
        manager.save(step, model, optimizer, scheduler)
        assert not is_complete(tmp_path, step, parts)  # the orchestrator's part is missing
        OrchestratorState(step=step).save(tmp_path, keep=2)
        assert is_complete(tmp_path, step, parts) and step_marker_path(tmp_path, step).is_file()
    # Whole steps go: no step keeps one part while the other was deleted.
    assert all_steps(tmp_path) == [3, 4]
    assert complete_steps(tmp_path, parts) == [3, 4]


def test_a_failed_part_leaves_the_previous_complete_step_resumable(tmp_path, monkeypatch):
    """The full-disk case: the trainer cannot write step 3 while the orchestrator, running ahead,
    writes its parts of steps 3 to 5; step 2 must keep both its parts."""
    parts = ("trainer", "orchestrator")
    manager = CheckpointManager(tmp_path, keep=2, world=WORLD, parts=parts)
    model, optimizer, scheduler = _linear()
    for step in (1, 2):
        OrchestratorState(step=step).save(tmp_path, keep=2)
        manager.save(step, model, optimizer, scheduler)

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(CheckpointManager, "_write", no_space)
    with pytest.raises(
        CheckpointWriteError, match=r"step 3 could not be written.*newest complete checkpoint is step 2"
    ):
        manager.save(3, model, optimizer, scheduler)
    for step in (3, 4, 5):
        OrchestratorState(step=step).save(tmp_path, keep=2)
    assert find_resume_point(tmp_path, None, parts).step == 2
    assert not (step_dir(tmp_path, 3) / ".trainer.tmp").exists()
    fresh = _linear()
    manager.load(2, *fresh)
    assert torch.equal(fresh[0].weight, model.weight)


def test_resave_same_step_replaces_it(tmp_path):
    manager = CheckpointManager(tmp_path, keep=1, world=WORLD)
    model, optimizer, scheduler = _linear()
    manager.save(3, model, optimizer, scheduler, extra={"v": 1})
    with torch.no_grad():
        model.weight.add_(1.0)
    manager.save(3, model, optimizer, scheduler, extra={"v": 2})
    fresh = _linear()
    assert manager.load(3, *fresh) == {"v": 2}
    assert torch.equal(fresh[0].weight, model.weight)
    meta = json.loads((step_dir(tmp_path, 3) / "trainer" / "meta.json").read_text())
    assert meta["step"] == 3 and meta["world_size"] == 1


def test_extra_must_be_json(tmp_path):
    manager = CheckpointManager(tmp_path, keep=1, world=WORLD)
    with pytest.raises(ValueError, match="JSON-serializable"):
        manager.save(1, *_linear(), extra={"t": torch.zeros(1)})

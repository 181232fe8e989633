"""Runs that would report success having done nothing stop with an error that says which and why."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from prime_composer.config.base import ModelConfig
from prime_composer.config.errors import RUN_ERROR_EXIT_CODE, RunError
from prime_composer.config.orchestrator import FailureConfig
from prime_composer.config.resolve import resolve_rl_config
from prime_composer.config.trainer import TrainerConfig
from prime_composer.launch.launcher import LaunchResult
from prime_composer.launch.rl import _resume_hint
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.stream import FailureWatch, StepRollouts
from prime_composer.trainer import train as train_module
from prime_composer.trainer.model import World
from prime_composer.trainer.step import StepResult
from prime_composer.trainer.train import Trainer

WORLD = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def sample(reward: float = 0.0, error: str | None = None) -> Sample:
    return Sample([1], [2], [-0.1], [1], reward, 0, 0, 0, error=error)


def test_a_step_where_every_rollout_failed_stops_the_run() -> None:
    watch = FailureWatch(FailureConfig())
    ok = StepRollouts(kept=[sample(1.0)], generated=[sample(1.0)], num_errors=3)
    watch.check(0, ok)  # some failures: recorded, the run goes on
    failed = StepRollouts(num_errors=8, error_examples=["ProviderError: prompt is longer than max_model_len"])
    with pytest.raises(RunError, match=r"step 1: 8 of 8 rollouts failed.*max_model_len"):
        watch.check(1, failed)
    strict = FailureWatch(FailureConfig(max_error_fraction=0.5))
    with pytest.raises(RunError, match="3 of 4 rollouts failed"):
        strict.check(0, StepRollouts(kept=[sample()], generated=[sample()], num_errors=3))


def test_steps_with_nothing_to_train_on_stop_the_run_after_a_few() -> None:
    watch = FailureWatch(FailureConfig(max_empty_steps=2))
    empty = StepRollouts(generated=[sample()] * 4, num_zero_variance_groups=2)
    watch.check(0, empty)
    watch.check(1, StepRollouts(kept=[sample()], generated=[sample()]))  # a step with data resets it
    watch.check(2, empty)
    with pytest.raises(
        RunError, match=r"no sample to train on for 2 steps in a row.*2 groups with equal rewards"
    ):
        watch.check(3, empty)


def trainer(tmp_path: Path, **overrides) -> Trainer:
    config = TrainerConfig(model=ModelConfig(name="builtin:tiny-qwen3"), output_dir=tmp_path, **overrides)
    return Trainer(config, WORLD)


def test_diverged_policy_stops_after_max_skipped_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.set_num_threads(1)
    t = trainer(tmp_path, max_skipped_steps=2)

    def nan_step(*args, **kwargs) -> StepResult:
        return StepResult(loss=torch.tensor(math.nan), metrics={}, num_tokens=1)

    monkeypatch.setattr(train_module, "train_step", nan_step)
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    assert t.step([])["train/skipped"] == 1.0  # one skipped step: logged, the run goes on
    with pytest.raises(RunError, match=r"not finite 2 steps in a row.*trainer.optim.lr"):
        t.step([])
    assert all(torch.equal(before[k], v) for k, v in t.model.state_dict().items())  # never updated


def test_non_finite_weights_are_never_published(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    t = trainer(tmp_path)
    with torch.no_grad():
        next(t.model.parameters()).view(-1)[0] = math.inf
    with pytest.raises(RunError, match=r"not finite|non-finite"):
        t.publish(1)
    assert not (tmp_path / "broadcasts" / "step_1").exists()


def test_resume_hint_only_when_resuming_can_help(tmp_path: Path) -> None:
    config, _ = resolve_rl_config(["--output-dir", str(tmp_path)])
    crashed = LaunchResult(1, failed="trainer", reason="trainer exited with code -9", failed_exit_code=-9)
    assert "No checkpoint to resume from" in _resume_hint(config, ["@", "x.toml"], crashed)
    stopped = LaunchResult(1, failed="orchestrator", reason="...", failed_exit_code=RUN_ERROR_EXIT_CODE)
    hint = _resume_hint(config, ["@", "x.toml"], stopped)
    assert "--resume" not in hint and "would stop the same way" in hint and "logs/orchestrator.log" in hint

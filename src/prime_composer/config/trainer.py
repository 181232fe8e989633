"""Config of the ``trainer`` process."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from prime_composer.config.base import DEFAULT_OUTPUT_DIR, BaseConfig, CheckpointConfig, ModelConfig


class TrainerConfig(BaseConfig):
    """The trainer: reads batches, computes the loss, steps the optimizer, publishes weights."""

    model: ModelConfig = ModelConfig()
    """Shared with the other processes (set it at the top level)."""

    output_dir: Path = DEFAULT_OUTPUT_DIR
    """Shared run directory (rollouts, broadcasts, checkpoints, logs, metrics live under it)."""

    max_steps: int = Field(default=20, ge=1)
    """Shared: number of optimizer steps."""

    seed: int = 0
    """Shared seed for model init, data order and sampling."""

    max_async_level: int = Field(default=1, ge=0)
    """Shared: how many steps the orchestrator may run ahead of the trainer's weights."""

    ckpt: CheckpointConfig = CheckpointConfig()
    """Shared checkpoint settings."""

    num_ranks: int = Field(default=1, ge=1)
    """Data-parallel ranks; more than 1 runs under torchrun with FSDP2."""

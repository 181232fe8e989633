"""Config of the ``trainer`` process."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from prime_composer.config.base import DEFAULT_OUTPUT_DIR, BaseConfig, CheckpointConfig, ModelConfig
from prime_composer.config.loss import LossConfig
from prime_composer.config.optim import OptimConfig
from prime_composer.config.transport import TransportConfig


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

    transport: TransportConfig = TransportConfig()
    """Shared: how batches arrive from the orchestrator."""

    num_ranks: int = Field(default=1, ge=1)
    """Data-parallel ranks; more than 1 runs under torchrun with FSDP2."""

    optim: OptimConfig = OptimConfig()
    """Optimizer and learning-rate schedule."""

    loss: LossConfig = LossConfig()
    """The loss terms: ``total = rl + sdpo.weight * sdpo``."""

    mixed_precision: bool = False
    """FSDP2 only: compute in bfloat16 with float32 gradient reduction (GPU runs)."""

    keep_broadcasts: int = Field(default=3, ge=1)
    """How many of the newest published weight versions to keep under ``broadcasts/``."""

    num_threads: int | None = Field(default=None, ge=1)
    """CPU threads for torch (``torch.set_num_threads``); ``None`` leaves torch's default."""

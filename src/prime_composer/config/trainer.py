"""Config of the ``trainer`` process."""

from __future__ import annotations

from pydantic import Field

from prime_composer.config.common import CommonConfig
from prime_composer.config.diloco import DilocoConfig
from prime_composer.config.loss import LossConfig
from prime_composer.config.optim import OptimConfig


class TrainerConfig(CommonConfig):
    """The trainer: reads batches, computes the loss, steps the optimizer, publishes weights."""

    num_ranks: int = Field(default=1, ge=1)
    """Data-parallel ranks; more than 1 runs under torchrun with FSDP2."""

    optim: OptimConfig = OptimConfig()
    """Optimizer and learning-rate schedule."""

    loss: LossConfig = LossConfig()
    """The loss terms: ``total = rl + sdpo.weight * sdpo``."""

    mixed_precision: bool = False
    """FSDP2 only: compute in bfloat16 with float32 gradient reduction (GPU runs)."""

    max_skipped_steps: int = Field(default=3, ge=1)
    """Stop the run (an error saying so) after this many optimizer steps in a row were skipped for a
    non-finite loss or gradient norm: the policy has diverged and more steps will not help."""

    diloco: DilocoConfig = DilocoConfig()
    """The Streaming DiLoCo outer loop across data centers (``rl`` copies the top-level ``[diloco]``)."""

    keep_broadcasts: int = Field(default=3, ge=1)
    """How many of the newest published weight versions to keep under ``broadcasts/``."""

    num_threads: int | None = Field(default=None, ge=1)
    """CPU threads for torch (``torch.set_num_threads``); ``None`` leaves torch's default."""

"""Config of the optimizer (AdamW) and its learning-rate schedule, shared by ``trainer`` and ``sft``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from prime_composer.config.base import MAX_LR, BaseConfig


class OptimConfig(BaseConfig):
    """AdamW with warmup then a constant, linear or cosine learning-rate schedule."""

    lr: float = Field(default=1e-5, gt=0, le=MAX_LR)
    """Peak learning rate, reached at the end of warmup."""

    weight_decay: float = Field(default=0.01, ge=0)
    """Decoupled (AdamW) weight decay on matrices; norms and biases (1-D parameters) get none."""

    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2): decay rates of the first and second moment estimates."""

    eps: float = Field(default=1e-8, gt=0)
    """AdamW epsilon added to the denominator."""

    max_grad_norm: float = Field(default=1.0, ge=0)
    """Clip the global gradient norm (over all ranks) to this value; 0 disables clipping (the norm
    is still computed and logged)."""

    defer_grad_sync: bool = False
    """FSDP gradient accumulation: reduce-scatter gradients once, after a step's last micro-batch
    (fewer collectives, but every rank holds full-size unsharded gradients meanwhile), instead of
    after every micro-batch (the default: sharded gradients only). No effect on one rank."""

    warmup_steps: int = Field(default=0, ge=0)
    """Steps of linear warmup: step ``s`` (0-based) uses ``lr * (s + 1) / warmup_steps``."""

    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning rate after warmup: ``constant`` stays at ``lr``; ``linear`` and ``cosine`` decay from
    ``lr`` to ``lr * min_lr_ratio`` at the last step."""

    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Final learning rate of the ``linear`` and ``cosine`` schedules, as a fraction of ``lr``."""

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"each beta must be in [0, 1), got {betas}")
        return betas

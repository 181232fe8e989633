"""The keys every process of a run shares, declared once.

``RLConfig`` holds them at the top level and ``config/shared.py`` copies them into every section
that declares them (the trainer and orchestrator sections inherit this class; the inference
section declares the few it uses), so one run cannot train one model and sample from another.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from prime_composer.config.base import (
    DEFAULT_OUTPUT_DIR,
    MAX_STEPS,
    BaseConfig,
    CheckpointConfig,
    ModelConfig,
)
from prime_composer.config.transport import TransportConfig


class CommonConfig(BaseConfig):
    """Shared keys (set them once, at the top level of an ``rl`` config)."""

    model: ModelConfig = ModelConfig()
    """The policy model, for every process."""

    output_dir: Path = DEFAULT_OUTPUT_DIR
    """Run directory: configs/, logs/, metrics/, rollouts/, broadcasts/, checkpoints/."""

    max_steps: int = Field(default=20, ge=1, le=MAX_STEPS)
    """Number of training steps (optimizer steps of the trainer, batches of the orchestrator)."""

    seed: int = Field(default=0, ge=0, lt=2**63)
    """Seed for initialisation, data order and sampling (a non-negative 64-bit integer)."""

    max_async_level: int = Field(default=1, ge=0)
    """How many steps the orchestrator may sample ahead of the trainer's weights (0 = on-policy)."""

    ckpt: CheckpointConfig = CheckpointConfig()
    """Checkpointing and resume."""

    transport: TransportConfig = TransportConfig()
    """How batches travel from the orchestrator to the trainer."""


SHARED_KEYS: tuple[str, ...] = tuple(CommonConfig.model_fields)
"""Top-level keys of ``RLConfig`` copied into every section that has a field of the same name."""

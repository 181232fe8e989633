"""Config of the ``orchestrator`` process."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from prime_composer.config.base import DEFAULT_OUTPUT_DIR, BaseConfig, CheckpointConfig, ModelConfig


class OrchestratorConfig(BaseConfig):
    """The orchestrator: samples rollouts, scores them, computes advantages, packs batches."""

    model: ModelConfig = ModelConfig()
    """Shared with the other processes (set it at the top level)."""

    output_dir: Path = DEFAULT_OUTPUT_DIR
    """Shared run directory."""

    max_steps: int = Field(default=20, ge=1)
    """Shared: number of training steps to produce batches for."""

    seed: int = 0
    """Shared seed for data order and sampling."""

    max_async_level: int = Field(default=1, ge=0)
    """Shared: never sample with weights more than this many steps behind the batch's step."""

    ckpt: CheckpointConfig = CheckpointConfig()
    """Shared checkpoint settings."""

    base_url: str = "http://127.0.0.1:8000/v1"
    """OpenAI-compatible endpoint of the inference server (the ``rl`` launcher sets it)."""

    batch_size: int = Field(default=32, ge=1)
    """Samples (rollouts) per training step."""

    group_size: int = Field(default=8, ge=1)
    """Rollouts per example; advantages are computed within each group."""

    seq_len: int = Field(default=512, ge=16)
    """Maximum packed sequence length in tokens."""

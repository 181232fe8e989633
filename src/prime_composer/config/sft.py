"""Config of the ``sft`` command: supervised fine-tuning on chat JSONL (e.g. the warm-up before RL)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from prime_composer.config.base import (
    DEFAULT_OUTPUT_DIR,
    MAX_STEPS,
    BaseConfig,
    CheckpointConfig,
    ModelConfig,
)
from prime_composer.config.optim import OptimConfig


class SFTConfig(BaseConfig):
    """Supervised fine-tuning: next-token loss on the assistant turns of chat conversations."""

    model: ModelConfig = ModelConfig()
    """The model to fine-tune."""

    output_dir: Path = DEFAULT_OUTPUT_DIR
    """Run directory: metrics go to ``<output_dir>/metrics/sft.jsonl``, checkpoints to
    ``<output_dir>/sft/checkpoints/``, the final model to ``<output_dir>/sft/final/`` (a Hugging Face
    directory: set ``model.name`` to it to use the fine-tuned model anywhere)."""

    data: Path
    """JSONL file, one conversation per line: ``{"messages": [{"role": "user", "content": "..."},
    {"role": "assistant", "content": "..."}, ...]}``. Every line needs at least one assistant turn."""

    max_steps: int = Field(default=100, ge=1, le=MAX_STEPS)
    """Number of optimizer steps (the data is repeated in a new shuffled order each epoch)."""

    batch_size: int = Field(default=16, ge=1)
    """Conversations per optimizer step, over all ranks; a multiple of ``micro_batch_size`` times
    the number of ranks."""

    micro_batch_size: int = Field(default=8, ge=1)
    """Conversations per forward/backward pass on one rank (gradients accumulate over them)."""

    seq_len: int = Field(default=2048, ge=2)
    """Maximum tokens per conversation; longer ones are cut at the end (the count is logged)."""

    label_smoothing: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Cross-entropy label smoothing: each target keeps ``1 - label_smoothing`` of its mass and the
    rest is spread evenly over the vocabulary, which caps the model's confidence per token (0 =
    plain cross-entropy)."""

    seed: int = 0
    """Seed of the data order and of torch's generators."""

    optim: OptimConfig = OptimConfig()
    """Optimizer and learning-rate schedule."""

    ckpt: CheckpointConfig = CheckpointConfig()
    """Checkpoints, under ``<output_dir>/sft/checkpoints`` (``--resume`` continues from the newest)."""

    log_every: int = Field(default=1, ge=1)
    """Print a progress line every this many steps (metrics are written every step)."""

    num_threads: int | None = Field(default=None, ge=1)
    """CPU threads for torch (``torch.set_num_threads``); ``None`` leaves torch's default."""

    @model_validator(mode="after")
    def _micro_batch_fits(self) -> SFTConfig:
        if self.micro_batch_size > self.batch_size:
            raise ValueError(
                f"micro_batch_size ({self.micro_batch_size}) must be <= batch_size ({self.batch_size})"
            )
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of micro_batch_size "
                f"({self.micro_batch_size})"
            )
        return self

"""Config of the ``trainer`` process."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from prime_composer.config.base import MAX_LORA_ALPHA, BaseConfig, ModelConfig
from prime_composer.config.common import CommonConfig
from prime_composer.config.diloco import DilocoConfig
from prime_composer.config.loss import LossConfig
from prime_composer.config.optim import OptimConfig

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The attention and MLP projections of Qwen, Llama, Mistral and most decoder-only models."""


class LoraConfig(BaseConfig):
    """Train low-rank adapters instead of every weight (peft's LoRA): each targeted linear layer
    ``W0`` becomes ``W0 + (alpha / rank) * B @ A`` with ``A`` (``rank x in``) and ``B``
    (``out x rank``, zero at the start) trained and ``W0`` frozen. Only the adapter is published
    each step, checkpointed and (optionally) exported."""

    enabled: bool = True
    """Train adapters; the section's presence turns LoRA on, ``enabled = false`` turns it off again."""

    rank: int = Field(default=16, ge=1, le=1024)
    """Rank ``r`` of every adapter (the ``vllm`` backend serves ranks up to 512)."""

    alpha: float = Field(default=32.0, gt=0, le=MAX_LORA_ALPHA)
    """Scale numerator: the update is ``(alpha / rank) * B @ A``."""

    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input during training (none at inference)."""

    target_modules: tuple[str, ...] = DEFAULT_LORA_TARGETS
    """Names of the linear layers to adapt, matched against the last part of each module's name
    (``q_proj`` adapts ``model.layers.*.self_attn.q_proj``). Each must match at least one linear
    layer of the model; the output head (``lm_head``) and embeddings cannot be adapted."""

    export: Literal["merged", "adapter"] = "merged"
    """What ``<output_dir>/final/`` holds: ``merged``, a plain Hugging Face model with the adapter
    folded into its weights; ``adapter``, the peft adapter directory (``adapter_config.json``,
    ``adapter_model.safetensors``) plus the tokenizer, for ``PeftModel.from_pretrained`` on the base."""

    @field_validator("target_modules")
    @classmethod
    def _check_targets(cls, targets: tuple[str, ...]) -> tuple[str, ...]:
        if not targets:
            raise ValueError("give at least one module name, e.g. ['q_proj', 'v_proj']")
        bad = [t for t in targets if not t or not all(part.isidentifier() for part in t.split("."))]
        if bad:
            raise ValueError(f"{bad[0]!r} is not a module name (letters, digits, '_', dotted parts)")
        for t in targets:
            if t.split(".")[-1] in ("lm_head", "embed_tokens"):
                raise ValueError(
                    f"{t!r}: the output head and the embeddings cannot be adapted (they may be tied, "
                    "and vLLM serves adapters on linear layers only); target the projections"
                )
        if len(set(targets)) != len(targets):
            raise ValueError(f"{list(targets)} names a module twice")
        return targets


class ParallelConfig(BaseConfig):
    """How the trainer's ranks hold the model: FSDP2 over all of them (the default), or HSDP.

    HSDP (hybrid sharding, torchtitan's ``dp_replicate x dp_shard``) arranges the ranks as a
    ``replicate x shard`` grid: each group of ``shard`` consecutive ranks holds one whole copy of
    the model, sharded over its ranks, and the ``replicate`` copies average their gradients. Across
    nodes that is "replicate across nodes, shard within": the parameter all-gathers and gradient
    reduce-scatters stay on a node's fast links, and only one all-reduce of each gradient shard
    crosses between nodes. Every rank still trains on its own share of the batch."""

    replicate: int = Field(default=1, ge=1)
    """Copies of the model (HSDP's replicate dimension); 1: plain FSDP2 over all ranks. PRIME-RL's
    ``trainer.model.dp_replicate``."""

    shard: int | None = Field(default=None, ge=1)
    """Ranks each copy is sharded over; ``None``: ``trainer.num_ranks / replicate``. When given,
    ``replicate * shard`` must equal ``trainer.num_ranks``."""


class TrainerModelConfig(ModelConfig):
    """The policy model (shared with the other processes) plus what only the trainer uses."""

    lora: LoraConfig | None = None
    """Train LoRA adapters instead of every weight (``[trainer.model.lora]``); ``None``: full
    fine-tuning."""

    @property
    def lora_enabled(self) -> bool:
        """Whether this run trains adapters."""
        return self.lora is not None and self.lora.enabled


class TrainerConfig(CommonConfig):
    """The trainer: reads batches, computes the loss, steps the optimizer, publishes weights."""

    model: TrainerModelConfig = TrainerModelConfig()
    """The policy model, for every process (set it at the top level), plus ``lora`` (trainer only)."""

    @field_validator("model", mode="before")
    @classmethod
    def _shared_model(cls, value: Any) -> Any:
        # The shared ModelConfig (what every other process holds) is a trainer model without LoRA.
        if isinstance(value, ModelConfig) and not isinstance(value, TrainerModelConfig):
            return value.model_dump(exclude_unset=True)
        return value

    num_ranks: int = Field(default=1, ge=1)
    """Data-parallel ranks; more than 1 runs under torchrun with FSDP2."""

    parallel: ParallelConfig = ParallelConfig()
    """FSDP2 over every rank, or HSDP (``replicate x shard``) with ``replicate > 1``."""

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

    export_final: bool = True
    """At the end of the run, write ``<output_dir>/final/``: the model as a Hugging Face directory
    (safetensors, config, tokenizer, chat template) with a model card. ``rl export`` writes one
    from any checkpoint later."""

    keep_broadcasts: int = Field(default=3, ge=1)
    """How many of the newest published weight versions to keep under ``broadcasts/``."""

    num_threads: int | None = Field(default=None, ge=1)
    """CPU threads for torch (``torch.set_num_threads``); ``None`` leaves torch's default."""

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """``(replicate, shard)`` of the trainer's device mesh; ``(1, num_ranks)`` is plain FSDP2."""
        replicate = self.parallel.replicate
        return replicate, self.parallel.shard or self.num_ranks // replicate

    @model_validator(mode="after")
    def _check_parallel(self) -> TrainerConfig:
        replicate, shard = self.parallel.replicate, self.parallel.shard
        if self.num_ranks % replicate:
            raise ValueError(
                f"trainer.parallel.replicate = {replicate} does not divide trainer.num_ranks = "
                f"{self.num_ranks}: each copy of the model is sharded over num_ranks / replicate ranks, "
                f"so make num_ranks a multiple of {replicate} (or lower replicate)"
            )
        if shard is not None and replicate * shard != self.num_ranks:
            raise ValueError(
                f"trainer.parallel.replicate x trainer.parallel.shard = {replicate} x {shard} = "
                f"{replicate * shard}, but trainer.num_ranks = {self.num_ranks}: the grid must hold every "
                f"rank once; set shard = {self.num_ranks // replicate} or remove trainer.parallel.shard "
                "(it then follows from num_ranks / replicate)"
            )
        return self

    @model_validator(mode="after")
    def _check_lora(self) -> TrainerConfig:
        if self.model.lora_enabled and self.diloco.enabled:
            raise ValueError(
                "trainer.model.lora and diloco are both on: the DiLoCo outer loop averages whole "
                "weights across data centers; turn one of them off"
            )
        return self

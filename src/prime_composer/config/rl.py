"""``RLConfig``: the root config of ``rl``, holding one section per process plus shared keys."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from prime_composer.config.base import MAX_LR, MAX_STEPS, BaseConfig
from prime_composer.config.common import CommonConfig
from prime_composer.config.diloco import DilocoConfig
from prime_composer.config.inference import InferenceConfig
from prime_composer.config.orchestrator import OrchestratorConfig
from prime_composer.config.teacher import TeacherServiceConfig
from prime_composer.config.tracking import WandbConfig
from prime_composer.config.trainer import TrainerConfig


class LaunchConfig(BaseConfig):
    """How the ``rl`` launcher starts, watches and stops the processes."""

    health_timeout_s: float = Field(default=300.0, gt=0)
    """Seconds to wait for the inference server's ``/health`` before giving up."""

    stop_timeout_s: float = Field(default=10.0, gt=0)
    """Seconds a process gets to exit after SIGTERM before it is killed."""

    progress: bool = True
    """Show the live progress display (turn off for plain logs, e.g. in CI)."""

    refresh_s: float = Field(default=1.0, gt=0)
    """Seconds between progress display refreshes."""

    gpus: dict[str, list[int]] = Field(default_factory=dict)
    """GPUs per process on this node, e.g. ``{inference = [0, 1], trainer = [2, 3, 4, 5, 6, 7]}``:
    each listed process sees only its own (``CUDA_VISIBLE_DEVICES``), so the inference server and
    the trainer never share one. A process left out sees every GPU. The trainer needs one GPU per
    rank (``trainer.num_ranks``); vLLM one per tensor-parallel shard."""

    overwrite: bool = False
    """Start fresh even when ``output_dir`` holds checkpoints of an earlier run (they are deleted,
    with its rollouts, broadcasts, metrics and logs). Without it such a run must be resumed
    (``--resume``) or given another ``output_dir``."""

    @field_validator("gpus")
    @classmethod
    def _check_gpus(cls, gpus: dict[str, list[int]]) -> dict[str, list[int]]:
        from prime_composer.config.processes import SECTION_NAMES

        seen: dict[int, str] = {}
        for name, ids in gpus.items():
            if name not in SECTION_NAMES:
                raise ValueError(
                    f"launch.gpus.{name}: not a process; the processes are {', '.join(SECTION_NAMES)}"
                )
            if not ids or any(i < 0 for i in ids):
                raise ValueError(
                    f"launch.gpus.{name} = {ids}: list GPU indices (0, 1, ...), or leave the process out"
                )
            for i in ids:
                if i in seen:
                    raise ValueError(
                        f"launch.gpus: GPU {i} is given to both {seen[i]} and {name}; give each process its own"
                    )
                seen[i] = name
        return gpus


class WarmupConfig(BaseConfig):
    """An optional supervised warm-up before RL (a tiny random model needs one to get any reward).

    The launcher writes SFT data from the orchestrator's environments (reference answers of the
    train split) unless ``data`` is given, runs ``sft`` on it, and starts RL from the result
    (``<output_dir>/sft/final``).
    """

    enabled: bool = False
    """Run the warm-up before RL."""

    data: Path | None = None
    """JSONL of chats (``{"messages": [...]}`` per line) to train on; ``None`` generates it from the
    environments' train split."""

    num_examples: int = Field(default=1000, ge=1)
    """Conversations to generate when ``data`` is not given."""

    max_steps: int = Field(default=30, ge=1, le=MAX_STEPS)
    """SFT optimizer steps."""

    batch_size: int = Field(default=16, ge=1)
    """Conversations per SFT step."""

    lr: float = Field(default=1e-3, gt=0, le=MAX_LR)
    """SFT learning rate (constant)."""

    label_smoothing: float = Field(default=0.0, ge=0.0, lt=1.0)
    """SFT label smoothing (``sft.label_smoothing``). A smoothed warm-up learns to rank the
    reference answer first without becoming confident in it, which leaves RL room to improve."""


class RLConfig(BaseSettings, CommonConfig):
    """Everything ``rl`` needs: shared keys at the top, one section per process.

    Shared keys (``model``, ``output_dir``, ``max_steps``, ``seed``, ``max_async_level``,
    ``ckpt``, ``transport``) are set once here and copied into every section that uses them.
    """

    model_config = SettingsConfigDict(
        env_prefix="PRIME_COMPOSER_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
        use_attribute_docstrings=True,
        protected_namespaces=(),
        allow_inf_nan=False,
    )

    trainer: TrainerConfig = TrainerConfig()
    """The trainer process."""

    orchestrator: OrchestratorConfig = OrchestratorConfig()
    """The orchestrator process."""

    inference: InferenceConfig = InferenceConfig()
    """The inference server process."""

    teacher: TeacherServiceConfig | None = None
    """The trace-replay teacher service, started by ``rl`` when this section is present (its pool
    of teacher endpoints has no default): it replays rollouts and traces and writes DPO pairs that
    ``orchestrator.replay`` mixes into batches."""

    diloco: DilocoConfig = DilocoConfig()
    """The optional Streaming DiLoCo outer loop: this run is one data center of several (``[diloco]``)."""

    warmup: WarmupConfig = WarmupConfig()
    """Optional SFT warm-up stage before RL."""

    launch: LaunchConfig = LaunchConfig()
    """The launcher itself."""

    wandb: WandbConfig | None = None
    """Optional experiment tracking: one W&B run per launch, fed from ``metrics/*.jsonl``
    (``[wandb]``; an empty table turns it on with the defaults)."""

"""Configs of the commands that work on a checkpoint after (or during) a run: ``eval`` and ``rl export``.

Both read the run's own ``rl`` config (the same files, PRIME-RL's names included), so the model,
the environments and the inference settings are the ones the run trained with, plus a few keys of
their own at the top level (``--checkpoint <dir>``, ``--num-samples 8``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from prime_composer.config.cli import dialect
from prime_composer.config.rl import RLConfig


class ExportConfig(RLConfig):
    """``rl export``: a checkpoint as a Hugging Face model directory with a model card."""

    checkpoint: Path | None = None
    """What to export: a trainer checkpoint (``checkpoints/step_N``), a published weights directory
    (``broadcasts/step_N``) or a model directory; ``None``: the newest complete trainer checkpoint
    under ``<output_dir>/checkpoints``."""

    export_dir: Path | None = None
    """Where to write it; ``None``: ``<output_dir>/final``."""

    force: bool = False
    """Replace ``export_dir`` when it exists (``--force``); without it an existing target is refused,
    so an export never deletes a directory by surprise."""


class EvalRunConfig(RLConfig):
    """``eval``: a checkpoint on the eval split of every environment that has one (``eval_args``)."""

    checkpoint: Path | None = None
    """What to evaluate: a trainer checkpoint (``checkpoints/step_N``, converted first), a published
    weights directory (``broadcasts/step_N``) or a model directory (``<output_dir>/final``);
    ``None`` evaluates ``model.name`` itself (the base model)."""

    num_samples: int = Field(default=1, ge=1)
    """Samples per task (k). Above 1, pass@1..pass@k are reported and ``temperature`` must be > 0."""

    temperature: float | None = Field(default=None, ge=0)
    """Sampling temperature; ``None`` uses ``orchestrator.eval.temperature`` for one sample per task
    and ``orchestrator.sampling.temperature`` for several."""

    success_threshold: float = 1.0
    """A sample counts as correct (for accuracy and pass@k) when its reward is at least this."""

    num_examples: int | None = Field(default=None, ge=1)
    """Evaluate the first this-many tasks of each eval split; ``None``: each entry's
    ``num_eval_examples`` (all tasks when that is unset too)."""

    results_dir: Path | None = None
    """Where ``results.jsonl`` and ``summary.json`` go; ``None``: ``<output_dir>/eval/<checkpoint
    name>`` (the model card of an export lists the summaries found there)."""

    @model_validator(mode="after")
    def _check_sampling(self) -> EvalRunConfig:
        if self.num_samples > 1 and self.sampling_temperature() == 0:
            raise ValueError(
                f"num_samples = {self.num_samples} at temperature 0 gives the same answer k times, so pass@k "
                "would equal pass@1: set temperature > 0 (e.g. --temperature 1.0) or num_samples = 1"
            )
        return self

    def sampling_temperature(self) -> float:
        if self.temperature is not None:
            return self.temperature
        if self.num_samples > 1:
            return self.orchestrator.sampling.temperature
        return self.orchestrator.eval.temperature


def resolve_kwargs(model: type[RLConfig]) -> dict[str, Any]:
    """The ``run_entry_point`` / ``build_config`` arguments that read ``model`` like ``rl`` does."""
    from prime_composer.config.resolve import ENV_PREFIX, RL_ALIASES, finalize_rl_config

    return {
        "env_prefix": ENV_PREFIX,
        "aliases": RL_ALIASES,
        "finalize": finalize_rl_config,
        "translate": dialect("prime-rl", model),
    }

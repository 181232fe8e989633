"""Config of the environments the orchestrator samples from, and of sampling itself.

``[[orchestrator.env]]`` entries name a verifiers v1 environment (a taskset package) and the
arguments of its taskset config; ``[orchestrator.sampling]`` holds the knobs sent with every
chat-completions request. No verifiers import here: the ids are resolved by
``prime_composer.orchestrator.envs`` when the orchestrator starts.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from prime_composer.config.base import BaseConfig


class EnvConfig(BaseConfig):
    """One ``[[orchestrator.env]]`` entry: a verifiers v1 environment and how much of each batch it gets."""

    id: str
    """Environment id: a folder under ``orchestrator/environments/`` (e.g. ``arith``) or an installed
    verifiers v1 taskset package (``my-env`` imports ``my_env``)."""

    args: dict[str, Any] = Field(default_factory=dict)
    """Fields of the environment's taskset config (e.g. ``{max_operand = 9}``); unknown keys are
    errors raised by the environment when it loads."""

    eval_args: dict[str, Any] | None = None
    """Taskset fields that select the held-out evaluation split, applied over ``args`` (e.g.
    ``{split = "eval"}``); ``None`` means this environment is not evaluated."""

    num_eval_examples: int | None = Field(default=None, ge=1)
    """Evaluate on the first this-many tasks of the eval split; ``None`` evaluates all of them."""

    name: str | None = None
    """Label used in metrics (``env/<name>/reward``); defaults to ``id``. Must be unique."""

    ratio: float = Field(default=1.0, gt=0)
    """Relative share of training examples drawn from this environment when several are listed;
    shares are normalized over all entries."""

    @property
    def label(self) -> str:
        """The name metrics use for this environment."""
        return self.name or self.id

    @model_validator(mode="after")
    def _check_eval(self) -> EnvConfig:
        if self.num_eval_examples is not None and self.eval_args is None:
            raise ValueError(
                f"orchestrator.env (id={self.id!r}): num_eval_examples is set but eval_args is not; "
                "set eval_args (e.g. {split = 'eval'}) to say which tasks are held out"
            )
        return self


class SamplingConfig(BaseConfig):
    """Sampling parameters sent with every rollout request (OpenAI chat-completions fields)."""

    temperature: float = Field(default=1.0, ge=0)
    """Softmax temperature; 1.0 samples from the policy itself (what on-policy RL assumes)."""

    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling mass; below 1.0 the sampled logprobs no longer match the policy."""

    top_k: int | None = Field(default=None, ge=-1)
    """Sample among the k most likely tokens (vLLM extension); ``None`` leaves it to the server."""

    min_p: float | None = Field(default=None, ge=0, le=1)
    """Drop tokens below this fraction of the top token's probability (vLLM extension)."""

    max_tokens: int = Field(default=64, ge=1)
    """Maximum completion tokens per model call; a completion that hits it is truncated."""

    stop: list[str] | None = None
    """Extra stop strings; the chat template's end-of-turn token always stops."""

    seed: int | None = Field(default=None, ge=0, lt=2**63)
    """When set, every request carries its own seed derived from this one, the example and the
    rollout index (reproducible sampling); ``None`` sends no seed."""

    repetition_penalty: float | None = Field(default=None, gt=0)
    """vLLM repetition penalty; ``None`` leaves it to the server."""

    extra_body: dict[str, Any] = Field(default_factory=dict)
    """Further request fields passed through unchanged (server-specific knobs)."""

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stop: list[str] | None) -> list[str] | None:
        if stop is not None and any(s == "" for s in stop):
            raise ValueError('an empty stop string would end every completion at once: remove ""')
        return stop


class RolloutConfig(BaseConfig):
    """How rollouts are run: concurrency, retries and time limits (not sent to the server)."""

    max_concurrent: int = Field(default=64, ge=1)
    """Rollouts in flight at once, across all environments."""

    max_retries: int = Field(default=0, ge=0)
    """Times a failed rollout is run again before it is recorded as an error sample."""

    timeout_s: float | None = Field(default=600.0, gt=0)
    """Wall-clock limit of one rollout's model calls, in seconds; ``None`` waits forever."""

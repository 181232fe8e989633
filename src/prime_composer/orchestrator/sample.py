"""One scored rollout, as the orchestrator passes it from the rollout stage to packing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prime_composer.orchestrator.record import EpisodeRecord


@dataclass
class Sample:
    """A finished rollout with everything the trainer needs, plus bookkeeping.

    ``completion_ids``, ``completion_logprobs`` and ``completion_mask`` have one entry per
    completion token. For multi-turn rollouts the completion is everything after the first prompt:
    tokens the policy generated have mask 1 and their sampling logprobs; tool or environment tokens
    spliced in between turns have mask 0 (no loss) and logprob 0.0.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    """Logprob of each sampled token under the inference server, after temperature."""
    completion_mask: list[int]
    reward: float
    example_id: int
    """Index of the dataset example; samples of one group share it."""
    group_id: int
    """Which group (one example x ``group_size`` rollouts) the sample belongs to."""
    policy_step: int
    """Trainer step whose weights generated the sample (for off-policy bookkeeping)."""
    advantage: float = 0.0
    is_truncated: bool = False
    """The completion hit ``max_tokens`` (candidates for the overlong penalty/filter)."""
    error: str | None = None
    """Set when the rollout failed (bad model output, env error): recorded as data, reward 0."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Per-sample environment metrics (e.g. individual reward functions), averaged into logs."""
    episode: EpisodeRecord = field(default_factory=EpisodeRecord)
    """The episode it came from: conversation, task, per-turn records, where the error is
    (``record.py``), typed from the rollout to the teacher service."""
    channels: dict[str, Any] = field(default_factory=dict)
    """What channels attach to the sample by channel name (``orchestrator/channel.py``), e.g. the
    SDPO target of a hinted sample (``orchestrator/sdpo/target.py``); read by their packers."""

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if len(self.completion_logprobs) != n or len(self.completion_mask) != n:
            raise ValueError(
                f"Sample: completion_ids ({n}), completion_logprobs ({len(self.completion_logprobs)}) "
                f"and completion_mask ({len(self.completion_mask)}) must have the same length"
            )

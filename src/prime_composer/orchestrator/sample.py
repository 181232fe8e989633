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
    """The rollout's advantage, given to every policy token unless ``turn_advantages`` says otherwise."""
    turn_advantages: list[TurnAdvantage] | None = None
    """Per-turn advantages (per-step process credit, ``advantages.py``): each listed turn's policy
    tokens get its own value instead of ``advantage``; None (the default, and always without
    per-step credit): every policy token gets ``advantage``. Read through ``token_advantages``."""
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
        for turn in self.turn_advantages or ():
            start, end = turn.span
            if not 0 <= start <= end <= n:
                raise ValueError(
                    f"Sample: turn advantage span {turn.span} is outside the completion (0, {n})"
                )

    def token_advantages(self) -> list[float]:
        """The advantage of each completion token: 0 where ``completion_mask`` is 0, the value of
        the turn whose span holds it where ``turn_advantages`` lists one, else ``advantage``."""
        out = [self.advantage if m else 0.0 for m in self.completion_mask]
        for turn in self.turn_advantages or ():
            start, end = turn.span
            for t in range(start, end):
                if self.completion_mask[t]:
                    out[t] = turn.advantage
        return out


@dataclass(frozen=True)
class TurnAdvantage:
    """The advantage of one assistant turn's tokens, ``completion_ids[span[0]:span[1]]``."""

    span: tuple[int, int]
    advantage: float


@dataclass(frozen=True)
class StepReward:
    """The teachers' process reward of one assistant turn of a Sample."""

    index: int
    """Turn number in the episode (``TurnInfo.index``): the order of steps for returns."""
    span: tuple[int, int]
    """The turn's tokens in the Sample's completion (``TurnInfo.span``)."""
    reward: float | None
    """In [-1, 1] (``teacher.votes.process_reward``); None: the teachers labeled no state of it."""


@dataclass(frozen=True)
class ProcessReward:
    """What the teacher service's store says of one finished rollout (``replay/shaping.py``)."""

    mean: float
    """Mean process reward over the episode's labeled steps (the sequence-level credit)."""
    steps: tuple[StepReward, ...] = ()
    """This Sample's own turns, labeled or not (the per-step credit)."""

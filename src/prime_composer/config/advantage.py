"""Config of the orchestrator's advantage computation (``[orchestrator.advantage]``).

The defaults are Dr. GRPO-style (group-mean baseline, no std scaling) with DAPO's dynamic
sampling; the soft overlong penalty is off until ``overlong_buffer`` is set.
"""

from __future__ import annotations

import logging
from typing import Literal

from pydantic import Field, model_validator

from prime_composer.config.base import BaseConfig

logger = logging.getLogger(__name__)


class AdvantageConfig(BaseConfig):
    """How rewards become per-sample advantages, and which groups are kept."""

    std_scaling: bool = False
    """Divide each advantage by its group's reward std (GRPO). Off = Dr. GRPO, which avoids
    up-weighting groups whose rewards barely differ."""

    dynamic_sampling: bool = True
    """Drop groups whose rewards are all equal (zero advantage, no gradient) and sample more
    groups until the batch is full (DAPO)."""

    overlong_buffer: int = Field(default=0, ge=0)
    """DAPO soft overlong penalty: length of the band, in tokens, before the completion budget
    (``max_tokens``) in which the reward is linearly reduced. 0 turns the penalty off."""

    overlong_penalty: float = Field(default=1.0, ge=0.0)
    """Penalty at the end of the band (a completion of ``max_tokens`` tokens or more gets
    ``-overlong_penalty`` added to its reward)."""

    process_reward_weight: float = Field(default=0.0, ge=0.0)
    """Weight ``w`` of the replay channel's process rewards in the advantages (0 = off, the
    numerics are exactly those without it). Before its group's baseline, each rollout's reward gets
    ``w * p`` added, where ``p`` in [-1, 1] is the mean, over the rollout's steps whose state the
    teacher service has labeled, of its own action's vote share minus the largest share of any
    other action at that state (+1: every teacher would have done the same, -1: they all agree on
    something else); a rollout with no labeled step gets nothing. ``reward`` itself stays the
    environment's, and dynamic sampling looks at the shaped values. Needs the teacher service's
    store: a ``[teacher]`` section (or ``orchestrator.replay.store``). ``process_reward_credit``
    says whether the whole rollout or each step gets the credit."""

    process_reward_credit: Literal["sequence", "step", "return", "potential"] = "sequence"
    """Where the process rewards go (``orchestrator/advantages.py`` has the formulas). ``sequence``:
    the rollout's mean process reward shapes its reward before the group baseline (above), and all
    its tokens share one advantage. ``step``: the group advantage is that of the outcome alone, and
    each labeled assistant turn's tokens get ``A + w * (p_k - b)``, with ``p_k`` the process reward
    of that turn's own action and ``b`` the mean process reward of the group's other rollouts
    (leave-one-out, PRIME-style; 0 when none is labeled); a turn no teacher labeled keeps ``A``.
    ``return``: as ``step``, but each turn gets the sum of ``p_j - b`` over itself and the later
    labeled turns of its episode (PRIME's return-to-go, undiscounted). ``potential``: potential-based
    shaping (Ng et al. 1999), which cannot change the optimal policy: each turn k's tokens get
    ``A + w * (gamma * Phi(s_k+1) - Phi(s_k))``, with ``Phi`` of a state the process reward of the
    latest labeled step in its history (0 before any, and 0 once the episode has ended), so an
    episode's shaping sums to a constant. With ``process_reward_weight = 0`` every choice is
    exactly the computation without process rewards (and a non-default choice logs a warning)."""

    process_reward_gamma: float = Field(default=1.0, gt=0.0, le=1.0)
    """Discount ``gamma`` of ``process_reward_credit = "potential"`` (ignored by the other rules)."""

    @model_validator(mode="after")
    def _credit_without_weight(self) -> AdvantageConfig:
        if self.process_reward_weight == 0 and self.model_fields_set & {
            "process_reward_credit",
            "process_reward_gamma",
        }:
            logger.warning(
                "orchestrator.advantage.process_reward_credit = %r has no effect: "
                "process_reward_weight is 0 (process rewards are off); set "
                "orchestrator.advantage.process_reward_weight > 0 to use it",
                self.process_reward_credit,
            )
        return self

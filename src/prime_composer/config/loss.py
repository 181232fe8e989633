"""Config of the trainer's loss terms: the RL (policy-gradient) term and the SDPO distillation term.

The objective is ``sum_k loss.<k>.weight * L_k`` over the sections below (``rl`` with weight 1, plus
``sdpo.weight * L_sdpo``, later the replay term); each term is normalized by its own global count.
Every section is a loss term of ``trainer/losses/`` registered under the section's name. The sampling
temperature is deliberately not here: it belongs to the sampling config and the trainer passes the
same value to every loss so that trainer and inference logprobs describe the same distribution.
"""

from __future__ import annotations

from typing import ClassVar, Literal, Self, cast

from pydantic import Field, model_validator

from prime_composer.config.base import BaseConfig
from prime_composer.config.dpo import DPOLossConfig
from prime_composer.config.sections import ChannelSections, Weighted, registered


class RLLossConfig(BaseConfig):
    """Clipped importance-weighted policy gradient (GRPO / DAPO / Dr. GRPO / GSPO variants)."""

    weight: float = Field(default=1.0, ge=0.0)
    """Weight of the RL term in the objective; 0 turns it off (e.g. distillation only)."""

    eps_low: float = Field(default=0.2, ge=0.0, lt=1.0)
    """Lower clip: the ratio is clipped at ``1 - eps_low`` (only binds for negative advantages)."""

    eps_high: float = Field(default=0.28, ge=0.0, le=10.0)
    """Upper clip: the ratio is clipped at ``1 + eps_high`` (DAPO clip-higher: larger than ``eps_low``
    lets rare tokens with positive advantage grow faster)."""

    ratio_level: Literal["token", "sequence"] = "token"
    """``token``: one ratio per token (PPO/GRPO). ``sequence``: the geometric mean of the token ratios
    of each sequence, shared by all its tokens (GSPO)."""

    aggregation: Literal["token_mean", "sequence_mean", "constant"] = "token_mean"
    """How per-token losses become one number. ``token_mean`` (DAPO, default): sum over every loss token
    of the step divided by the global number of loss tokens. ``sequence_mean`` (original GRPO): mean
    over each sequence's tokens, then mean over the global number of sequences (biased towards short
    sequences). ``constant`` (Dr. GRPO): sum divided by ``constant_normalizer``."""

    constant_normalizer: float | None = Field(default=None, gt=0.0)
    """Denominator for ``aggregation = "constant"`` (required there, not allowed otherwise). Dr. GRPO
    uses sequences per step (all ranks) x maximum completion tokens."""

    mask_ratio_low: float | None = Field(default=0.125, gt=0.0)
    """Tokens whose ratio (at ``ratio_level``) is below this get no policy gradient (trainer and
    inference disagree too much to trust them). They still count in the denominator. None = off."""

    mask_ratio_high: float | None = Field(default=8.0, gt=0.0)
    """Tokens whose ratio (at ``ratio_level``) is above this get no policy gradient. None = off."""

    kl_coef: float = Field(default=0.0, ge=0.0)
    """Weight of the k3 KL estimate to the reference model (the run's initial policy), added per
    token (TRL's ``beta``). 0 = off: no reference copy is made and no reference forward runs."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.aggregation == "constant" and self.constant_normalizer is None:
            raise ValueError(
                'loss.rl.aggregation = "constant" needs loss.rl.constant_normalizer '
                "(e.g. sequences per step x max completion tokens, as in Dr. GRPO)"
            )
        if self.aggregation != "constant" and self.constant_normalizer is not None:
            raise ValueError(
                f'loss.rl.constant_normalizer is only used with aggregation = "constant" (it is '
                f'"{self.aggregation}"): remove it or set loss.rl.aggregation = "constant"'
            )
        if self.mask_ratio_low is not None and self.mask_ratio_low >= 1.0:
            raise ValueError(
                f"loss.rl.mask_ratio_low = {self.mask_ratio_low} would mask on-policy tokens (ratio 1): "
                "use a value below 1 (e.g. 0.125) or None"
            )
        if self.mask_ratio_high is not None and self.mask_ratio_high <= 1.0:
            raise ValueError(
                f"loss.rl.mask_ratio_high = {self.mask_ratio_high} would mask on-policy tokens (ratio 1): "
                "use a value above 1 (e.g. 8.0) or None"
            )
        return self


class SDPOLossConfig(BaseConfig):
    """Hint distillation: generalized JSD between the hinted teacher and the unhinted student."""

    weight: float = Field(default=0.0, ge=0.0)
    """alpha in ``L_rl + alpha * L_sdpo``. 0 = off: no teacher model, no teacher forward."""

    beta: float = Field(default=0.5, ge=0.0, le=1.0)
    """Generalized JSD interpolation: 0 = forward KL(teacher || student) (mass-covering), 1 = reverse
    KL(student || teacher) (mode-seeking), in between the JSD with mixture
    ``beta * P_teacher + (1 - beta) * P_student``."""

    top_k: int | None = Field(default=None, ge=1)
    """Compare only the student's top-k tokens plus one tail bucket holding the remaining mass of each
    distribution (``log(1 - sum top-k)``); a k above the vocabulary size means the whole vocabulary.
    None = the full vocabulary."""

    token_clip: float | None = Field(default=None, gt=0.0)
    """Cap on each token's divergence; a token above it contributes the cap and no gradient (a few
    tokens where the hint changes everything cannot dominate the step). None = no cap."""

    teacher: Literal["live", "ema", "frozen"] = "ema"
    """Teacher weights: ``live`` = the current policy (reported to diverge), ``ema`` = an exponential
    moving average of the policy (default), ``frozen`` = the initial policy."""

    ema_rate: float = Field(default=0.99, ge=0.0, lt=1.0)
    """EMA decay per optimizer step: ``teacher = ema_rate * teacher + (1 - ema_rate) * policy``.
    Only for ``teacher = "ema"``."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.teacher != "ema" and "ema_rate" in self.model_fields_set:
            raise ValueError(
                f'loss.sdpo.ema_rate only applies to loss.sdpo.teacher = "ema" (it is "{self.teacher}"): '
                'remove ema_rate or set teacher = "ema"'
            )
        return self


class LossConfig(ChannelSections):
    """All loss terms of the trainer, each with its own section (a registered plugin channel's
    section too: ``config/sections.py``)."""

    channel_kind: ClassVar[Literal["loss", "orchestrator"]] = "loss"

    rl: RLLossConfig = RLLossConfig()
    """The RL (policy-gradient) term."""

    sdpo: SDPOLossConfig = SDPOLossConfig()
    """The SDPO hint-distillation term (off while ``weight = 0``)."""

    replay: DPOLossConfig = DPOLossConfig()
    """The replay term: DPO on the teacher service's pairs (off while ``weight = 0``; needs
    ``orchestrator.replay.enabled``)."""

    def sections(self) -> list[tuple[str, Weighted]]:
        """Every channel's section, in registration order (the built-ins first)."""
        return [(spec.name, cast(Weighted, self.section(spec.name))) for spec in registered()]

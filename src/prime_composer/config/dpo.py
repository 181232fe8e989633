"""Config of the trainer's replay term: DPO on the step-level pairs of the teacher service.

The objective is ``L_rl + sdpo.weight * L_sdpo + replay.weight * L_dpo``; ``L_dpo`` is the sum of
the per-pair losses over the step's global pair count (``trainer/losses/dpo.py``). The pairs and
their reference logprobs come from the ``teacher`` service (``config/teacher.py``).
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, model_validator

from prime_composer.config.base import BaseConfig

DPOLossType = Literal["sigmoid", "ipo", "robust"]


class DPOLossConfig(BaseConfig):
    """Direct preference optimization on (context, chosen, rejected) pairs against a frozen reference."""

    weight: float = Field(default=0.0, ge=0.0)
    """beta_replay in ``L_rl + ... + weight * L_dpo``. 0 = off: no pair is loaded and no chosen or
    rejected forward runs."""

    loss_type: DPOLossType = "sigmoid"
    """``sigmoid``: ``-log sigmoid(beta * h)`` with ``h`` the chosen-minus-rejected log-ratio margin
    (DPO; with label smoothing the conservative cDPO mixture). ``ipo``: ``(h' - 1 / (2 beta))**2``
    with ``h'`` the margin of the per-token averaged log-ratios (IPO, as TRL normalizes it).
    ``robust``: the unbiased loss under label noise of rDPO, which needs ``label_smoothing < 0.5``."""

    beta: float = Field(default=0.1, gt=0.0)
    """Temperature of the implicit reward ``beta * log(pi / pi_ref)`` (sigmoid, robust); for ``ipo``
    the regularization ``tau``, whose target margin is ``1 / (2 beta)``."""

    label_smoothing: float = Field(default=0.0, ge=0.0, lt=0.5)
    """Probability that a pair's preference is flipped (sigmoid, robust), used for every pair when
    ``label_smoothing_from_votes`` is off. Not used by ``ipo``."""

    label_smoothing_from_votes: bool = True
    """Use each pair's own smoothing, derived by the teacher service from the teachers' vote share
    (``1 - share``, capped by ``teacher.pairs.max_label_smoothing``), instead of ``label_smoothing``.
    Not used by ``ipo``."""

    reference: Literal["stored", "refreshed"] = "stored"
    """``stored``: the reference sums the teacher service stored with each pair (the initial policy,
    never updated). ``refreshed``: the trainer keeps a copy of the policy as the reference, scores
    every pair with it (one more no-grad forward of the pair rows) and moves it toward the policy
    (TR-DPO, TRL's ``sync_ref_model``): ``ref <- alpha * policy + (1 - alpha) * ref`` every
    ``ref_sync_steps`` optimizer steps, and after a step whose drift exceeds ``ref_max_drift``."""

    ref_sync_steps: int | None = Field(default=512, ge=1)
    """Optimizer steps between two refreshes of a ``refreshed`` reference (TRL's
    ``ref_model_sync_steps``); None: only on drift."""

    ref_mixup_alpha: float = Field(default=0.6, gt=0.0, le=1.0)
    """How far a refresh moves the reference toward the policy (TRL's ``ref_model_mixup_alpha``;
    1 copies the policy)."""

    ref_max_drift: float | None = Field(default=None, gt=0.0)
    """Refresh after a step whose trained pairs' mean per-token ``|log pi - log pi_ref|``
    (``dpo/ref_drift``, over all ranks) is above this; None: on the schedule only."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.reference == "refreshed" and self.ref_sync_steps is None and self.ref_max_drift is None:
            raise ValueError(
                'loss.replay.reference = "refreshed" with ref_sync_steps = None and no ref_max_drift '
                'never refreshes: set ref_sync_steps or ref_max_drift, or use reference = "stored"'
            )
        if self.loss_type == "ipo" and self.label_smoothing > 0:
            raise ValueError(
                f'loss.replay.label_smoothing = {self.label_smoothing} is not used by loss_type = "ipo": '
                'remove it, or choose loss_type = "sigmoid" or "robust"'
            )
        if self.label_smoothing > 0 and self.label_smoothing_from_votes and self.loss_type != "ipo":
            raise ValueError(
                f"loss.replay.label_smoothing = {self.label_smoothing} is not used while "
                "label_smoothing_from_votes = true (each pair brings its own): set "
                "label_smoothing_from_votes = false to use one value for every pair"
            )
        return self

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

    @model_validator(mode="after")
    def _check(self) -> Self:
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

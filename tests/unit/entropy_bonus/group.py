"""The ``entropy_bonus`` batch group: which core tokens get the bonus."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from prime_composer.transport.batch import BatchFormatError, BatchGroup, MicroBatch, register_group


@register_group
@dataclass
class EntropyBonusGroup(BatchGroup):
    name: ClassVar[str] = "entropy_bonus"
    dtypes: ClassVar[dict[str, torch.dtype]] = {"token_mask": torch.bool}

    token_mask: torch.Tensor
    """``[R, T]``: tokens of failed rollouts (a subset of ``loss_mask``)."""

    def check(self, mb: MicroBatch) -> None:
        if self.token_mask.shape != mb.input_ids.shape or bool((self.token_mask & ~mb.loss_mask).any()):
            raise BatchFormatError("entropy_bonus.token_mask must be a subset of loss_mask")

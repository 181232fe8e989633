"""The entropy-bonus loss term: ``-sum_t H_t / N`` over the group's tokens (``N``: their global
count), ``H_t`` the entropy of the temperature-scaled distribution that predicts token ``t``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from entropy_bonus.group import EntropyBonusGroup
from entropy_bonus.spec import EntropyBonusLossConfig
from prime_composer.trainer.forward import ForwardOutput
from prime_composer.trainer.losses.aggregate import token_normalizer
from prime_composer.trainer.losses.base import LossTerm, TermContext, register_term
from prime_composer.transport.batch import MicroBatch


@register_term("entropy_bonus")
class EntropyBonusTerm(LossTerm):
    @classmethod
    def build(cls, cfg: EntropyBonusLossConfig, ctx: TermContext) -> EntropyBonusTerm:
        return cls(cfg.weight)

    def __init__(self, weight: float) -> None:
        super().__init__(weight)
        self.normalizer = 0.0

    def logits_mask(self, mb: MicroBatch) -> Tensor | None:
        group = mb.group(EntropyBonusGroup)
        return group.token_mask if group is not None else None

    def begin_step(self, micro_batches: Sequence[MicroBatch]) -> None:
        masks = [
            g.token_mask if (g := mb.group(EntropyBonusGroup)) else mb.loss_mask & False
            for mb in micro_batches
        ]
        self.normalizer = max(token_normalizer(masks), 1.0)

    def loss(self, index: int, mb: MicroBatch, out: ForwardOutput) -> tuple[Tensor, dict[str, Tensor]]:
        logits = out.logits.get(self.name)
        if logits is None:
            return out.logprobs.new_zeros(()), {}
        logp = torch.log_softmax(logits.float(), dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        count = torch.tensor(float(entropy.numel()))
        return -entropy.sum() / self.normalizer, {
            "entropy_bonus/entropy": torch.stack([entropy.sum().detach(), count])
        }

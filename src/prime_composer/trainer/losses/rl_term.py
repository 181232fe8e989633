"""The RL term of the objective: ``rl.py``'s clipped policy gradient as a ``LossTerm``.

Per step it computes the global normalizer for ``loss.rl.aggregation`` once (tokens, sequences or
the constant: ``aggregate.rl_normalizer``). With ``loss.rl.kl_coef > 0`` it also holds the KL
reference, the run's initial policy (the ``frozen`` policy copy, shared with an SDPO frozen
teacher), and scores each micro-batch's tokens with it under ``no_grad`` before the student
forward; ``rl_loss`` then adds ``kl_coef * k3`` per token (TRL's ``beta`` term).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from prime_composer.config.loss import RLLossConfig
from prime_composer.trainer.forward import ForwardOutput
from prime_composer.trainer.losses.aggregate import dense_segments, rl_normalizer
from prime_composer.trainer.losses.base import LossTerm, TermContext, register_term
from prime_composer.trainer.losses.rl import rl_loss
from prime_composer.trainer.policy_copy import PolicyCopy
from prime_composer.transport.batch import MicroBatch


@register_term("rl")
class RLTerm(LossTerm):
    """``trainer.loss.rl``: the policy-gradient term (and the KL-to-reference penalty)."""

    @classmethod
    def build(cls, cfg: RLLossConfig, ctx: TermContext) -> RLTerm:
        return cls(cfg, ctx.copy("frozen") if cfg.kl_coef > 0 else None)

    def __init__(self, cfg: RLLossConfig, reference: PolicyCopy | None = None) -> None:
        super().__init__(cfg.weight)
        self.cfg = cfg
        self.reference = reference
        self.normalizer = 0.0
        self._segments: list[Tensor] = []
        self._ref_logprobs: Tensor | None = None

    def begin_step(self, micro_batches: Sequence[MicroBatch]) -> None:
        self._segments = [dense_segments(mb.sample_ids) for mb in micro_batches]
        self.normalizer = rl_normalizer([mb.loss_mask for mb in micro_batches], self.cfg, self._segments)

    def prepare(self, index: int, mb: MicroBatch) -> None:
        if self.reference is not None:
            self._ref_logprobs = self.reference.token_logprobs(mb)

    def loss(self, index: int, mb: MicroBatch, out: ForwardOutput) -> tuple[Tensor, dict[str, Tensor]]:
        ref, self._ref_logprobs = self._ref_logprobs, None
        return rl_loss(
            out.logprobs,
            mb.inference_logprobs,
            mb.advantages,
            mb.loss_mask,
            self.cfg,
            self.normalizer,
            ref_logprobs=ref,
            entropy=out.entropy,
            segment_ids=self._segments[index].to(out.logprobs.device),
        )

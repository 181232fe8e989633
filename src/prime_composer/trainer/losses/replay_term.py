"""The replay term of the objective: DPO on the teacher service's step-level pairs (``dpo.py``).

Built only when ``loss.replay.weight > 0`` (with weight 0 no pair is packed and no pair forward
runs). A micro-batch's pairs travel in its ``replay`` group (``transport.groups.ReplayGroup``): rows of
``context + chosen`` and ``context + rejected``. Per micro-batch the term runs its own forward of
the policy on those rows (with gradient, at temperature 1: the pairs are not samples of the
sampling temperature), sums each side's token log-probabilities, and hands them with the stored
reference sums to ``dpo_loss``, normalized by the step's global number of pairs.

Collectives: the pair count is all-reduced, and so is the list of micro-batches that have pairs on
some rank; under FSDP a rank without pairs there runs a one-row forward whose (zero) loss joins the
graph, so every rank runs the same forwards and backwards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from prime_composer.config.dpo import DPOLossConfig
from prime_composer.trainer.forward import ForwardOutput, forward_rows
from prime_composer.trainer.losses.base import LossTerm, TermContext, register_term
from prime_composer.trainer.losses.dpo import dpo_loss, pair_normalizer
from prime_composer.transport.batch import MicroBatch
from prime_composer.transport.groups import ReplayGroup


@register_term("replay")
class ReplayTerm(LossTerm):
    """``trainer.loss.replay``: DPO on replayed (context, chosen, rejected) pairs."""

    @classmethod
    def build(cls, cfg: DPOLossConfig, ctx: TermContext) -> ReplayTerm:
        return cls(cfg, ctx.policy)

    def __init__(self, cfg: DPOLossConfig, policy: nn.Module) -> None:
        super().__init__(cfg.weight)
        self.cfg = cfg
        self.policy = policy
        self.normalizer = 0.0
        self.num_forwards = 0
        """Pair forwards run so far (tests check that weight 0 runs none)."""
        self._run: list[bool] = []

    def begin_step(self, micro_batches: Sequence[MicroBatch]) -> None:
        groups = [mb.group(ReplayGroup) for mb in micro_batches]
        self.normalizer = pair_normalizer(sum(g.num_pairs for g in groups if g is not None))
        needed = torch.tensor([g is not None for g in groups], dtype=torch.float32)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(needed, op=dist.ReduceOp.MAX)
        self._run = [bool(x) for x in needed.tolist()]

    def loss(self, index: int, mb: MicroBatch, out: ForwardOutput) -> tuple[Tensor, dict[str, Tensor]]:
        if not self._run[index]:
            return out.logprobs.new_zeros(()), {}
        group = mb.group(ReplayGroup)
        self.num_forwards += 1
        if group is None:
            # Another rank has pairs here: the same forward, on one padding row, adding 0.
            ids = torch.zeros((1, mb.input_ids.shape[1]), dtype=torch.long, device=mb.input_ids.device)
            positions = torch.arange(ids.shape[1], device=ids.device)[None]
            dummy = forward_rows(self.policy, ids, positions, torch.zeros_like(ids, dtype=torch.bool), 1.0)
            zero = dummy.logprobs.sum() * 0.0
            return zero, _empty_metrics(zero)
        side = forward_rows(
            self.policy, group.input_ids, group.position_ids, group.side_mask, 1.0, entropy=False
        )
        num_pairs = group.num_pairs
        mask, pairs, chosen = group.side_mask, group.pair_ids, group.is_chosen

        def per_pair(values: Tensor, want_chosen: bool) -> Tensor:
            select = mask & (chosen == want_chosen)
            total = values.new_zeros(num_pairs)
            return total.index_add(0, pairs[select], values[select])

        logps = side.logprobs
        ones = torch.ones_like(group.ref_logprobs)
        return dpo_loss(
            per_pair(logps, True),
            per_pair(logps, False),
            per_pair(group.ref_logprobs.to(logps.dtype), True),
            per_pair(group.ref_logprobs.to(logps.dtype), False),
            self.cfg,
            self.normalizer,
            num_chosen_tokens=per_pair(ones, True),
            num_rejected_tokens=per_pair(ones, False),
            label_smoothing=group.label_smoothing if self.cfg.label_smoothing_from_votes else None,
        )

    def step_metrics(self) -> dict[str, float]:
        return {"replay/num_pairs": self.normalizer}


def _empty_metrics(zero: Tensor) -> dict[str, Tensor]:
    """The metric keys ``dpo_loss`` reports, each with count 0, so every rank holds the same keys."""
    cfg = DPOLossConfig(weight=1.0)
    empty = zero.new_zeros(0)
    _, metrics = dpo_loss(
        empty, empty, empty, empty, cfg, 1.0, num_chosen_tokens=empty, num_rejected_tokens=empty
    )
    return {k: v * 0 for k, v in metrics.items()}

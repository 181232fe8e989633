"""The replay term of the objective: DPO on the teacher service's step-level pairs (``dpo.py``).

Built only when ``loss.replay.weight > 0`` (with weight 0 no pair is packed and no pair forward
runs). A micro-batch's pairs travel in its ``replay`` group (``transport.groups.ReplayGroup``): rows of
``context + chosen`` and ``context + rejected``. Per micro-batch the term runs its own forward of
the policy on those rows (with gradient, at temperature 1: the pairs are not samples of the
sampling temperature), sums each side's token log-probabilities, and hands them with the stored
reference sums to ``dpo_loss``, normalized by the step's global number of pairs.

Held-out pairs (``ReplayGroup.heldout``: the orchestrator's fixed held-out set, sent every
``orchestrator.replay.heldout_every`` steps) go through the same forward but not into the loss or
the normalizer; their TRL metrics are logged as ``dpo_heldout/*``. ``dpo/ref_drift`` is the trained
sides' mean per-token ``|log pi - log pi_ref|``. With ``loss.replay.reference = "refreshed"`` the
reference is the term's own copy of the policy (``RefreshedReference``, checkpointed with the
other copies), which scores every pair in ``prepare`` and is moved toward the policy on TR-DPO's
schedule or on drift.

Collectives: the pair count is all-reduced, and so is the list of micro-batches that have pairs on
some rank; under FSDP a rank without pairs there runs a one-row forward whose (zero) loss joins the
graph, so every rank runs the same forwards and backwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from prime_composer.config.dpo import DPOLossConfig
from prime_composer.trainer.forward import ForwardOutput, forward_rows
from prime_composer.trainer.losses.aggregate import metric_pair
from prime_composer.trainer.losses.base import LossTerm, TermContext, register_term
from prime_composer.trainer.losses.dpo import dpo_loss, pair_normalizer
from prime_composer.trainer.policy_copy import PolicyCopy
from prime_composer.transport.batch import MicroBatch
from prime_composer.transport.groups import ReplayGroup


class RefreshedReference(PolicyCopy):
    """The reference of ``loss.replay.reference = "refreshed"``: a copy of the policy at the start
    (a ``frozen`` copy), moved after an optimizer step by ``ref <- alpha * policy + (1 - alpha) *
    ref`` (TRL's ``SyncRefModelCallback``) every ``ref_sync_steps`` steps, or when the step's
    drift (``drift``: ``[sum, count]`` of per-token ``|log pi - log pi_ref|``, summed over ranks)
    is above ``ref_max_drift``. Under FSDP the mix works on each rank's local shards."""

    def __init__(
        self, policy: nn.Module, cfg: DPOLossConfig, make_copy: Callable[[], nn.Module] | None
    ) -> None:
        super().__init__(policy, "frozen", make_copy=make_copy)
        self.cfg = cfg
        self.steps = 0
        self.refreshes = 0
        self.drift = torch.zeros(2, dtype=torch.float64)

    @torch.no_grad()
    def update(self, policy: nn.Module) -> None:
        self.steps += 1
        due = self.cfg.ref_sync_steps is not None and self.steps % self.cfg.ref_sync_steps == 0
        if self.cfg.ref_max_drift is not None:
            drift = self.drift.clone()
            if dist.is_available() and dist.is_initialized():
                drift = drift.to(next(self.module.parameters()).device)
                dist.all_reduce(drift, op=dist.ReduceOp.SUM)
            total, count = drift.tolist()
            due = due or (count > 0 and total / count > self.cfg.ref_max_drift)
        self.drift.zero_()
        if due:
            alpha = self.cfg.ref_mixup_alpha
            for _, t, p in self._pairs(policy):
                t.mul_(1.0 - alpha).add_(p.to(t.dtype), alpha=alpha)
            self.refreshes += 1

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {"steps": self.steps, "refreshes": self.refreshes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.steps = int(state.get("steps", 0))
        self.refreshes = int(state.get("refreshes", 0))


def _padding_forward(model: nn.Module, mb: MicroBatch) -> ForwardOutput:
    """``model``'s forward on one all-padding row of ``mb``'s width: what a rank without pairs in a
    micro-batch runs so that every rank runs the same forwards (and FSDP's collectives match)."""
    ids = torch.zeros((1, mb.input_ids.shape[1]), dtype=torch.long, device=mb.input_ids.device)
    positions = torch.arange(ids.shape[1], device=ids.device)[None]
    return forward_rows(model, ids, positions, torch.zeros_like(ids, dtype=torch.bool), 1.0)


@register_term("replay")
class ReplayTerm(LossTerm):
    """``trainer.loss.replay``: DPO on replayed (context, chosen, rejected) pairs."""

    @classmethod
    def build(cls, cfg: DPOLossConfig, ctx: TermContext) -> ReplayTerm:
        term = cls(cfg, ctx.policy)
        if cfg.reference == "refreshed":
            term.reference = RefreshedReference(ctx.policy, cfg, ctx.make_copy)
            ctx.copies["replay_reference"] = term.reference  # updated and checkpointed with the others
        return term

    def __init__(self, cfg: DPOLossConfig, policy: nn.Module) -> None:
        super().__init__(cfg.weight)
        self.cfg = cfg
        self.policy = policy
        self.reference: RefreshedReference | None = None
        self._refs: dict[int, Tensor] = {}
        self.normalizer = 0.0
        self.num_forwards = 0
        """Pair forwards run so far (tests check that weight 0 runs none)."""
        self._run: list[bool] = []

    def begin_step(self, micro_batches: Sequence[MicroBatch]) -> None:
        groups = [mb.group(ReplayGroup) for mb in micro_batches]
        trained = sum(g.num_pairs - int(g.heldout.sum()) for g in groups if g is not None)
        self.normalizer = pair_normalizer(trained)
        needed = torch.tensor([g is not None for g in groups], dtype=torch.float32)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(needed, op=dist.ReduceOp.MAX)
        self._run = [bool(x) for x in needed.tolist()]

    @torch.no_grad()
    def prepare(self, index: int, mb: MicroBatch) -> None:
        if self.reference is None or not self._run[index]:
            return
        group = mb.group(ReplayGroup)
        self.reference.num_forwards += 1
        if group is None:  # the same forward as the ranks with pairs here, on one padding row
            _padding_forward(self.reference.module, mb)
            return
        self._refs[index] = forward_rows(
            self.reference.module, group.input_ids, group.position_ids, group.side_mask, 1.0, entropy=False
        ).logprobs

    def _reference(self, index: int, group: ReplayGroup) -> Tensor:
        """The reference logprob of each side token: the refreshed copy's, else the stored ones."""
        return self._refs.pop(index) if self.reference is not None else group.ref_logprobs

    def _drift(self, logps: Tensor, refs: Tensor, select: Tensor) -> dict[str, Tensor]:
        with torch.no_grad():
            gap = (logps.detach() - refs)[select].abs()
            total = gap.sum()
            if self.reference is not None:
                self.reference.drift += torch.stack([total.double().cpu(), torch.tensor(float(gap.numel()))])
        return {"dpo/ref_drift": metric_pair(total, gap.numel())}

    def loss(self, index: int, mb: MicroBatch, out: ForwardOutput) -> tuple[Tensor, dict[str, Tensor]]:
        if not self._run[index]:
            return out.logprobs.new_zeros(()), {}
        group = mb.group(ReplayGroup)
        self.num_forwards += 1
        if group is None:
            # Another rank has pairs here: the same forward, on one padding row, adding 0.
            zero = _padding_forward(self.policy, mb).logprobs.sum() * 0.0
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
        refs = self._reference(index, group).to(logps.dtype)
        sums = (
            per_pair(logps, True),
            per_pair(logps, False),
            per_pair(refs, True),
            per_pair(refs, False),
            per_pair(ones, True),
            per_pair(ones, False),
        )
        smoothing = group.label_smoothing.to(logps.device)
        held = group.heldout.to(logps.device)
        train, scored = (~held).nonzero()[:, 0], held.nonzero()[:, 0]

        def run(select: Tensor, normalizer: float) -> tuple[Tensor, dict[str, Tensor]]:
            c, r, c_ref, r_ref, n_c, n_r = (x[select] for x in sums)
            return dpo_loss(
                c, r, c_ref, r_ref, self.cfg, normalizer,
                num_chosen_tokens=n_c,
                num_rejected_tokens=n_r,
                label_smoothing=smoothing[select] if self.cfg.label_smoothing_from_votes else None,
            )  # fmt: skip

        loss, metrics = run(train, self.normalizer)
        with torch.no_grad():  # the held-out pairs are scored, never trained on
            _, heldout = run(scored, 1.0)
        metrics.update({_heldout_key(k): v for k, v in heldout.items()})
        metrics.update(self._drift(logps, refs, mask & ~held[pairs.clamp(min=0)]))
        # A micro-batch of held-out pairs only still joins the graph (every rank, every forward).
        return loss + logps.sum() * 0.0, metrics

    def step_metrics(self) -> dict[str, float]:
        metrics = {"replay/num_pairs": self.normalizer}
        if self.reference is not None:
            metrics["replay/ref_refreshes"] = float(self.reference.refreshes)
        return metrics


def _heldout_key(key: str) -> str:
    return key.replace("dpo/", "dpo_heldout/", 1)


def _empty_metrics(zero: Tensor) -> dict[str, Tensor]:
    """The metric keys ``loss`` reports, each with count 0, so every rank holds the same keys."""
    cfg = DPOLossConfig(weight=1.0)
    empty = zero.new_zeros(0)
    _, metrics = dpo_loss(
        empty, empty, empty, empty, cfg, 1.0, num_chosen_tokens=empty, num_rejected_tokens=empty
    )
    metrics |= {_heldout_key(k): v for k, v in metrics.items()}
    metrics["dpo/ref_drift"] = metric_pair(zero.new_zeros(()), 0)
    return {k: v * 0 for k, v in metrics.items()}

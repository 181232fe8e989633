"""One rank's forward/backward over a step's micro-batches: the loss terms, summed and normalized.

    terms = build_terms(config.loss, TermContext(model))          # once; weight-0 terms are absent
    result = train_step(model, micro_batches, terms, device, world_size)
    outcome = optimizer_step(model, optimizer, scheduler, max_grad_norm, result.loss)

The loss is ``sum_k weight_k * L_k`` over the enabled terms (``trainer/losses/base.py``), each
normalized by its own *global* count, so the gradient does not depend on how the step's samples
were split over ranks and micro-batches. Per micro-batch: every term's no-grad preparation
(teacher, reference forwards), one student forward (``trainer/forward.py``) that gives each term
the logits it asked for, the weighted sum, backward. The step knows no term by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from prime_composer.trainer.forward import forward_micro_batch
from prime_composer.trainer.losses.aggregate import accumulate_metrics, all_reduce_sum, finalize_metrics
from prime_composer.trainer.losses.base import LossTerm
from prime_composer.trainer.optim import set_grad_sync
from prime_composer.transport.batch import MicroBatch


@dataclass
class StepResult:
    """What ``train_step`` computed (gradients are left in the parameters' ``.grad``)."""

    loss: torch.Tensor
    """The step's total loss, summed over every rank (0-dim float32)."""
    metrics: dict[str, float]
    """``loss/<term>`` (unweighted, over every rank), the terms' reduced metrics and step metrics."""
    num_tokens: int
    """Non-padding tokens this rank processed."""


def train_step(
    model: nn.Module,
    micro_batches: Sequence[MicroBatch],
    terms: Sequence[LossTerm],
    device: torch.device,
    world_size: int = 1,
    defer_grad_sync: bool = False,
) -> StepResult:
    """Forward and backward over one rank's micro-batches of a step (gradients accumulate).

    Every rank must call it with the same number of micro-batches (packing guarantees it): the
    terms' normalizers and any FSDP forward are collectives.
    """
    for term in terms:
        term.begin_step(micro_batches)
    total = torch.zeros((), dtype=torch.float32, device=device)
    per_term = {term.name: torch.zeros((), dtype=torch.float32, device=device) for term in terms}
    acc: dict[str, torch.Tensor] = {}
    num_tokens = 0
    for index, mb in enumerate(micro_batches):
        num_tokens += int((mb.sample_ids >= 0).sum())  # before the copy to the device: no sync there
        mb = mb.to(device)
        for term in terms:
            term.prepare(index, mb)  # no-grad forwards first: their activations are gone before ours
        masks = {term.name: mask for term in terms if (mask := term.logits_mask(mb)) is not None}
        out = forward_micro_batch(model, mb, logits_masks=masks)
        loss = torch.zeros((), dtype=torch.float32, device=device)
        for term in terms:
            part, term_metrics = term.loss(index, mb, out)
            loss = loss + term.weight * part
            per_term[term.name] += part.detach().float()
            acc = accumulate_metrics(acc, term_metrics)
        set_grad_sync(model, index, len(micro_batches), defer_grad_sync)
        # The normalizers are global, so the step's gradient is the SUM of every rank's; FSDP
        # averages gradients over ranks, which the world-size factor undoes.
        (loss * world_size).backward()
        total += loss.detach().float()
        # Drop this micro-batch's outputs now, not when the next forward returns: a term's [N, V]
        # logits (SDPO's student rows) would otherwise be alive through the next teacher and
        # student forwards, at the step's memory peak.
        del out
    reduced = finalize_metrics(acc)
    for term in terms:
        reduced[f"loss/{term.name}"] = float(all_reduce_sum(per_term[term.name]))
        reduced.update(term.step_metrics())
    return StepResult(loss=all_reduce_sum(total), metrics=reduced, num_tokens=num_tokens)

"""AdamW, its learning-rate schedule, and gradient clipping that also works on FSDP2 shards.

Weight decay goes on matrices only: norms and biases (1-D parameters) are excluded, as in most
LLM recipes, because decaying a norm's gain toward 0 fights the normalisation. With FSDP2 the
parameters are DTensors whose ``ndim`` is the full tensor's, so the split is the same on every
rank and the same as unsharded.

The schedule is a ``LambdaLR`` over a pure function (``lr_factor``) of the number of optimizer
steps already taken, so a resumed run recomputes exactly the same learning rates from the
scheduler's saved step count.

``clip_grad_norm`` computes the global L2 norm. ``torch.nn.utils.get_total_norm`` on FSDP2 DTensor
gradients returns a replicated DTensor that already includes the all-reduce over ranks (checked
in ``tests/integration/test_fsdp.py`` against an unsharded run); we turn it into a plain tensor so
callers can log it and test it for finiteness the same way with or without FSDP.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from prime_composer.config.optim import OptimConfig

logger = logging.getLogger(__name__)


def lr_factor(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Multiplier of ``cfg.lr`` for the optimizer step with 0-based index ``step``.

    Warmup: ``(step + 1) / warmup_steps`` (the first step already moves; none is wasted at lr 0).
    After warmup, ``linear`` and ``cosine`` go from 1 at the first post-warmup step to
    ``min_lr_ratio`` at the last step (``max_steps - 1``).
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    num_decay_steps = max_steps - cfg.warmup_steps - 1
    progress = 1.0 if num_decay_steps <= 0 else min(1.0, (step - cfg.warmup_steps) / num_decay_steps)
    shape = 1.0 - progress if cfg.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices with ``weight_decay``, 1-D parameters (norms, biases) without.

    Tied parameters (e.g. input and output embeddings) appear once (``named_parameters``
    deduplicates them), and frozen parameters are left out.
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 else no_decay).append(param)
    if not decay and not no_decay:
        raise ValueError("the model has no trainable parameters (every requires_grad is False)")
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: OptimConfig, max_steps: int) -> tuple[torch.optim.AdamW, LambdaLR]:
    """AdamW over ``model`` (after sharding, so it holds the sharded parameters) and its schedule.

    ``max_steps`` is the total number of optimizer steps of the run; the ``linear`` and ``cosine``
    schedules reach ``lr * min_lr_ratio`` at the last one. Call ``scheduler.step()`` once after
    every ``optimizer.step()``.
    """
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    optimizer = torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        # foreach is the default on CPU and CUDA; fused needs every param on CUDA, so leave it off.
    )
    scheduler = LambdaLR(optimizer, lambda step: lr_factor(step, cfg, max_steps))
    return optimizer, scheduler


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global L2 norm of the gradients (all ranks) before clipping; scales them to ``max_norm``.

    ``max_norm <= 0`` only measures. Returns a plain 0-dim float32 tensor on the gradients'
    device, identical on every rank. A non-finite norm is returned as is and the gradients are
    left alone, so the caller can skip the step (check it *before* ``optimizer.step()``).
    """
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if hasattr(total, "full_tensor"):  # DTensor (FSDP2): replicated after the implicit all-reduce
        total = total.full_tensor()
    total = total.float()
    if max_norm > 0 and torch.isfinite(total):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total


def set_grad_sync(model: nn.Module, index: int, num_micro_batches: int, defer: bool) -> None:
    """Before micro-batch ``index``'s backward: under FSDP with ``defer`` (``optim.defer_grad_sync``),
    reduce-scatter only after the last micro-batch; otherwise after each. No-op without FSDP."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(not defer or index == num_micro_batches - 1)


@dataclass(frozen=True)
class StepOutcome:
    """What ``optimizer_step`` did."""

    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate the step used (before the schedule advanced)."""
    skipped: bool
    """The loss or gradient norm was not finite: no update (the schedule still advanced)."""


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    max_grad_norm: float,
    loss: torch.Tensor | None = None,
) -> StepOutcome:
    """The end of every training step (RL and SFT): clip, check, step, advance the schedule, clear.

    The loss (when given) and the gradient norm are checked *before* the optimizer step: a
    non-finite one skips the update, loudly, so one bad batch cannot destroy the weights. The
    schedule advances either way, so a skipped step does not shift the learning rates.
    """
    grad_norm = clip_grad_norm(model, max_grad_norm)
    finite = bool(torch.isfinite(grad_norm)) and (loss is None or bool(torch.isfinite(loss)))
    lr = float(scheduler.get_last_lr()[0])
    if finite:
        optimizer.step()
    else:
        logger.warning(
            "non-finite loss (%s) or gradient norm (%s): update skipped",
            None if loss is None else loss.item(),
            grad_norm.item(),
        )
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepOutcome(grad_norm=grad_norm.item(), lr=lr, skipped=not finite)

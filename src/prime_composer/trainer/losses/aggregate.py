"""Global denominators for the loss terms and exact reduction of their metrics.

Why global: a step's gradient must not depend on how its batch was split. If every micro-batch
divided by its own token count, 1 rank x 4 micro-batches and 2 ranks x 2 would weight tokens
differently. So the trainer step computes the denominator once, from all micro-batches of the
step and all data-parallel ranks, and each loss call divides its *sum* by it; the per-micro-batch
losses then add up to the step's loss::

    normalizer = rl_normalizer([mb.loss_mask for mb in micro_batches], cfg.rl)
    for mb in micro_batches:
        loss, metrics = rl_loss(..., normalizer=normalizer)
        loss.backward()                       # gradients accumulate to the step's gradient

Data parallelism: the loss on each rank already carries the global denominator, so the step's
gradient is the SUM of the ranks' gradients. DDP and FSDP2 average instead; multiply the loss by
the world size, or set FSDP2's gradient divide factor to 1 (``set_gradient_divide_factor(1.0)``).

Metrics are returned as ``[sum, count]`` pairs (a float32 tensor of shape [2]) so that they too
can be reduced exactly: ``accumulate_metrics`` adds micro-batches, ``finalize_metrics`` adds ranks
and divides.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from prime_composer.config.loss import RLLossConfig


def segment_index(loss_mask: Tensor, segment_ids: Tensor | None) -> Tensor:
    """Flat index of the sequence each token belongs to, for ``index_add_`` over ``B * T`` slots.

    Args:
        loss_mask: [B, T]; tokens outside it are sent to slot 0 and must carry weight 0.
        segment_ids: [B, T] integer id of the sequence (sample) each token belongs to, needed when
            several sequences are packed into one row; ids must lie in ``[0, B * T)`` and be unique
            per sequence within the micro-batch. None: each row is one sequence.

    Returns:
        [B * T] int64.
    """
    batch, seq_len = loss_mask.shape
    if segment_ids is None:
        rows = torch.arange(batch, device=loss_mask.device)
        return rows[:, None].expand(batch, seq_len).reshape(-1)
    if segment_ids.shape != loss_mask.shape:
        raise ValueError(
            f"segment_ids {tuple(segment_ids.shape)} must match loss_mask {tuple(loss_mask.shape)}"
        )
    return torch.where(loss_mask.bool(), segment_ids.long(), 0).reshape(-1)


def segment_token_counts(loss_mask: Tensor, segment_ids: Tensor | None) -> Tensor:
    """[B * T] float32: number of loss tokens of each sequence slot (see ``segment_index``)."""
    index = segment_index(loss_mask, segment_ids)
    counts = torch.zeros(loss_mask.numel(), dtype=torch.float32, device=loss_mask.device)
    return counts.index_add_(0, index, loss_mask.reshape(-1).float())


def _sum_over_ranks(local: Tensor, group: dist.ProcessGroup | None) -> float:
    if dist.is_available() and dist.is_initialized():
        local = local.clone()
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
    return float(local.item())


def token_normalizer(loss_masks: Sequence[Tensor], group: dist.ProcessGroup | None = None) -> float:
    """Number of loss tokens in all micro-batches of the step on all ranks of ``group``.

    The denominator of ``token_mean`` aggregation and of the SDPO loss. Sums over the
    data-parallel ranks with an all-reduce when ``torch.distributed`` is initialized (every rank
    must call it); ``group`` None means the default group.
    """
    if not loss_masks:
        raise ValueError("token_normalizer needs the loss masks of at least one micro-batch")
    local = sum(mask.float().sum() for mask in loss_masks)
    return _sum_over_ranks(torch.as_tensor(local, dtype=torch.float32), group)


def sequence_normalizer(
    loss_masks: Sequence[Tensor],
    segment_ids: Sequence[Tensor | None] | None = None,
    group: dist.ProcessGroup | None = None,
) -> float:
    """Number of sequences with at least one loss token, over all micro-batches and ranks.

    A sequence must not be split across micro-batches. ``segment_ids`` gives, per micro-batch,
    the packed-sequence ids (see ``segment_index``) or None when each row is one sequence.
    """
    if not loss_masks:
        raise ValueError("sequence_normalizer needs the loss masks of at least one micro-batch")
    if segment_ids is None:
        segment_ids = [None] * len(loss_masks)
    if len(segment_ids) != len(loss_masks):
        raise ValueError(f"got {len(loss_masks)} loss masks but {len(segment_ids)} segment id tensors")
    local = sum(
        (segment_token_counts(m, s) > 0).sum().float() for m, s in zip(loss_masks, segment_ids, strict=True)
    )
    return _sum_over_ranks(torch.as_tensor(local, dtype=torch.float32), group)


def rl_normalizer(
    loss_masks: Sequence[Tensor],
    cfg: RLLossConfig,
    segment_ids: Sequence[Tensor | None] | None = None,
    group: dist.ProcessGroup | None = None,
) -> float:
    """The denominator ``rl_loss`` needs for ``cfg.aggregation``, for the whole step.

    ``token_mean``: global loss-token count. ``sequence_mean``: global count of sequences with at
    least one loss token. ``constant``: ``cfg.constant_normalizer`` (no communication). Every rank
    must call it (it all-reduces in the first two modes when ``torch.distributed`` is initialized).
    """
    if cfg.aggregation == "token_mean":
        return token_normalizer(loss_masks, group)
    if cfg.aggregation == "sequence_mean":
        return sequence_normalizer(loss_masks, segment_ids, group)
    assert cfg.constant_normalizer is not None  # enforced by RLLossConfig
    return float(cfg.constant_normalizer)


def all_reduce_sum(value: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """``value`` summed over the ranks of ``group`` (a copy; ``value`` itself when not distributed)."""
    if dist.is_available() and dist.is_initialized():
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value


def dense_segments(sample_ids: Tensor) -> Tensor:
    """Sample ids renumbered 0..n-1 within a micro-batch (the ``segment_ids`` the losses index
    ``B * T`` slots with; padding, id -1, becomes a segment of its own with no loss token)."""
    return torch.unique(sample_ids, return_inverse=True)[1]


def metric_pair(total: Tensor, count: Tensor | float) -> Tensor:
    """A detached ``[sum, count]`` float32 pair, the metric format of every loss term."""
    count = torch.as_tensor(count, dtype=torch.float32, device=total.device)
    return torch.stack([total.detach().float(), count])


def accumulate_metrics(acc: dict[str, Tensor], new: dict[str, Tensor]) -> dict[str, Tensor]:
    """Add the ``[sum, count]`` pairs of ``new`` into ``acc`` (in place) and return ``acc``."""
    for key, pair in new.items():
        acc[key] = acc[key] + pair if key in acc else pair.clone()
    return acc


def finalize_metrics(acc: dict[str, Tensor], group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Sum the pairs over ranks (one all-reduce when distributed) and return ``sum / count``.

    All ranks must hold the same keys. A metric whose global count is 0 (e.g. no loss token at all)
    is left out rather than reported as NaN.
    """
    if not acc:
        return {}
    keys = sorted(acc)
    stacked = torch.stack([acc[k] for k in keys])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=group)
    stacked = stacked.cpu()
    return {k: float(s / c) for k, (s, c) in zip(keys, stacked.tolist(), strict=True) if c > 0}

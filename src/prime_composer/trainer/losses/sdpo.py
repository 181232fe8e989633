"""The SDPO term: generalized JSD pulling the unhinted student toward the hinted teacher.

With P_s = softmax(student_logits / T), P_t = softmax(teacher_logits / T) at one position and
M = beta * P_t + (1 - beta) * P_s:

    beta = 0:      KL(P_t || P_s)                       (forward KL, mass-covering)
    0 < beta < 1:  beta * KL(P_t || M) + (1 - beta) * KL(P_s || M)
    beta = 1:      KL(P_s || P_t)                       (reverse KL, mode-seeking)

The ends are special-cased because the JSD itself tends to 0 as beta -> 0 or 1 (only JSD / beta
and JSD / (1 - beta) tend to the KLs). Everything is computed in log space (the mixture with a
logsumexp). With ``top_k`` the divergence is taken over the student's top-k tokens plus one tail
bucket per distribution holding its remaining mass, a (k + 1)-category distribution that sums to
1; without the tail the truncated KL was found unstable (verl). The tail is the logsumexp of the
logits outside the top-k minus the full logsumexp, which stays exact when the tail is tiny (no
``1 - sum`` cancellation).

The teacher is detached here, so gradients reach only the student, whatever the caller passed.
The sum over SDPO tokens is divided by the step's global count of SDPO tokens
(``aggregate.token_normalizer``), like the RL term.

Memory: only the masked positions are taken out of the [B, T, V] logits, and they are processed in
row chunks under activation checkpointing, so the fp32 temporaries of one chunk are alive at a time.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from prime_composer.config.loss import SDPOLossConfig
from prime_composer.trainer.losses.aggregate import metric_pair

_LOG_FLOOR = -1e30
"""Logits and log-probabilities of -inf (masked vocab entries, an empty tail) are raised to this
finite value: their probability is still exactly 0, but no inf - inf turns a value or gradient
into NaN."""

_CHUNK_ELEMENTS = 1 << 24
"""fp32 elements per row chunk; each chunk creates several temporaries of this size."""


def _kl(log_p: Tensor, log_q: Tensor) -> Tensor:
    """KL(p || q) = sum p (log p - log q) over the last dim, from log-probabilities."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def generalized_jsd(student_log_probs: Tensor, teacher_log_probs: Tensor, beta: float) -> Tensor:
    """Generalized JSD between two distributions given as log-probabilities over the last dim.

    Args:
        student_log_probs: [..., K] log P_s (normalized over K).
        teacher_log_probs: [..., K] log P_t.
        beta: in [0, 1]; 0 gives KL(P_t || P_s), 1 gives KL(P_s || P_t).

    Returns:
        [...] divergence in nats.
    """
    log_s = student_log_probs.clamp(min=_LOG_FLOOR)
    log_t = teacher_log_probs.clamp(min=_LOG_FLOOR)
    if beta == 0.0:
        return _kl(log_t, log_s)
    if beta == 1.0:
        return _kl(log_s, log_t)
    log_m = torch.logaddexp(log_t + math.log(beta), log_s + math.log1p(-beta))
    return beta * _kl(log_t, log_m) + (1.0 - beta) * _kl(log_s, log_m)


def _topk_with_tail(logits: Tensor, index: Tensor) -> Tensor:
    """[N, k + 1] log-probabilities of ``softmax(logits)`` at ``index`` [N, k], then the tail's."""
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    picked = logits.gather(-1, index) - lse
    outside = logits.scatter(-1, index, _LOG_FLOOR)
    tail = torch.logsumexp(outside, dim=-1, keepdim=True) - lse
    return torch.cat([picked, tail], dim=-1)


def _per_token_divergence(
    student: Tensor, teacher: Tensor, beta: float, temperature: float, top_k: int | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Divergence [N] for rows of logits [N, V]; also the student and teacher tail masses [N]."""
    # Finite floor for -inf logits (masked vocab entries): see _LOG_FLOOR.
    dtype = torch.promote_types(student.dtype, torch.float32)  # float64 stays float64 (tests)
    student = (student.to(dtype) / temperature).clamp(min=_LOG_FLOOR)
    teacher = (teacher.to(dtype) / temperature).clamp(min=_LOG_FLOOR)
    if top_k is None:
        log_s = torch.log_softmax(student, dim=-1)
        log_t = torch.log_softmax(teacher, dim=-1)
        no_tail = student.new_zeros(student.shape[0])
        return generalized_jsd(log_s, log_t, beta), no_tail, no_tail
    index = student.detach().topk(min(top_k, student.shape[-1]), dim=-1).indices
    log_s = _topk_with_tail(student, index)
    log_t = _topk_with_tail(teacher, index)
    return generalized_jsd(log_s, log_t, beta), log_s[:, -1].detach().exp(), log_t[:, -1].exp()


def sdpo_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    loss_mask: Tensor,
    cfg: SDPOLossConfig,
    temperature: float,
    normalizer: float | Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    """One micro-batch's share of the step's SDPO loss.

    Args:
        student_logits: [..., V] (e.g. [B, T, V]) student logits; differentiable. Position i must
            predict the same token as ``teacher_logits`` position i (the caller aligns the hinted
            teacher context with the student's).
        teacher_logits: [..., V] teacher logits at the aligned positions; detached here.
        loss_mask: [...] bool or 0/1: positions that take part (the tokens of the hinted turn).
        cfg: the ``loss.sdpo`` section (``weight`` is not applied here; the step multiplies).
        temperature: the sampling temperature (> 0); both logits are divided by it.
        normalizer: the step's global number of SDPO tokens (``aggregate.token_normalizer`` over
            all micro-batches and ranks). 0 gives a loss of 0.

    Returns:
        ``(loss, metrics)``: ``loss`` = sum over masked positions of the (clipped) per-token
        divergence / ``normalizer``, a scalar attached to the student's graph (0 with zero gradient
        for an empty mask). ``metrics`` (``[sum, count]`` pairs over masked positions):
        ``sdpo/divergence`` (before the clip), ``sdpo/clip_frac`` (with ``token_clip``),
        ``sdpo/student_tail_mass`` and ``sdpo/teacher_tail_mass`` (with ``top_k``).
    """
    if not temperature > 0:
        raise ValueError(f"sdpo_loss: temperature must be > 0 (the sampling temperature), got {temperature}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"sdpo_loss: student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} must have the same shape (align the positions first)"
        )
    if loss_mask.shape != student_logits.shape[:-1]:
        raise ValueError(
            f"sdpo_loss: loss_mask {tuple(loss_mask.shape)} must match the logits without the vocab dim "
            f"{tuple(student_logits.shape[:-1])}"
        )
    mask = loss_mask.bool()
    student = student_logits[mask]
    teacher = teacher_logits.detach()[mask]
    num_rows, num_vocab = student.shape

    parts = []
    step = max(1, _CHUNK_ELEMENTS // num_vocab)
    args = (cfg.beta, float(temperature), cfg.top_k)
    for start in range(0, num_rows, step):
        s, t = student[start : start + step], teacher[start : start + step]
        if torch.is_grad_enabled() and s.requires_grad:
            # Recompute the chunk's fp32 temporaries in backward instead of keeping them all.
            parts.append(checkpoint(_per_token_divergence, s, t, *args, use_reentrant=False))
        else:
            parts.append(_per_token_divergence(s, t, *args))
    if parts:
        divergence, student_tail, teacher_tail = (torch.cat(p) for p in zip(*parts, strict=True))
    else:
        # Empty mask: a zero that is still attached to the student, so backward gives zero grads.
        divergence = student.to(torch.promote_types(student.dtype, torch.float32)).sum(-1)
        student_tail = teacher_tail = divergence.detach()

    per_token = divergence
    if cfg.token_clip is not None:
        per_token = divergence.clamp(max=cfg.token_clip)
    denominator = torch.as_tensor(normalizer, dtype=per_token.dtype, device=per_token.device)
    loss = per_token.sum() / torch.where(denominator > 0, denominator, 1.0)

    with torch.no_grad():
        metrics = {"sdpo/divergence": metric_pair(divergence.sum(), num_rows)}
        if cfg.token_clip is not None:
            metrics["sdpo/clip_frac"] = metric_pair((divergence > cfg.token_clip).sum(), num_rows)
        if cfg.top_k is not None:
            metrics["sdpo/student_tail_mass"] = metric_pair(student_tail.sum(), num_rows)
            metrics["sdpo/teacher_tail_mass"] = metric_pair(teacher_tail.sum(), num_rows)
    return loss, metrics

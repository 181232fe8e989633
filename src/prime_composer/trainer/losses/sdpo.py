"""The SDPO term: generalized JSD pulling the unhinted student toward the hinted teacher.

With P_s = softmax(student_logits / T), P_t = softmax(teacher_logits / T) at one position and
M = beta * P_t + (1 - beta) * P_s:

    beta = 0:      KL(P_t || P_s)                       (forward KL, mass-covering)
    0 < beta < 1:  beta * KL(P_t || M) + (1 - beta) * KL(P_s || M)
    beta = 1:      KL(P_s || P_t)                       (reverse KL, mode-seeking)

The ends are special-cased because the JSD itself tends to 0 as beta -> 0 or 1 (only JSD / beta
and JSD / (1 - beta) tend to the KLs). With ``top_k`` the divergence is taken over the student's
top-k tokens plus one tail bucket per distribution holding its remaining mass, a (k + 1)-category
distribution that sums to 1; without the tail the truncated KL was found unstable (verl). The tail
is the logsumexp of the logits outside the top-k minus the full logsumexp, which stays exact when
the tail is tiny (no ``1 - sum`` cancellation).

How it departs from the textbook autograd version: the gradient is closed-form and computed in the
forward pass, chunk by chunk, so the backward pass is one multiplication and nothing is recomputed
(autograd through log-softmax, the mixture and the KLs keeps or recomputes about ten fp32 tensors
of the logits' size). With u the logits of the compared distribution (the vocabulary, or the k + 1
buckets), S = softmax(u), T = the teacher's and D the divergence:

    beta = 0:   dD/du = S - T
    beta = 1:   dD/du = S * (log S - log T - D)
    otherwise:  dD/du = (1 - beta) * S * (log S - log M - KL(S || M))

(from dD/dS = (1 - beta) * (log S - log M) + const, through the softmax Jacobian). For the buckets,
the tail's logit is the logsumexp of the logits outside the top-k, so its gradient reaches those
logits in proportion to their softmax within the tail. Logits are divided by T first, hence a
final 1 / T. ``tests/unit/test_loss_sdpo.py`` checks values and gradients against TRL and against
autograd of the plain formula.

The teacher is detached here, so gradients reach only the student, whatever the caller passed.
The sum over SDPO tokens is divided by the step's global count of SDPO tokens
(``aggregate.token_normalizer``), like the RL term.

Memory: the temporaries live one row chunk at a time (``_CHUNK_ELEMENTS``; on a CPU chunks are
kept cache-sized, which is also several times faster there); the only full-size tensor kept for
backward is the gradient ``[N, V]`` itself.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from prime_composer.config.loss import SDPOLossConfig
from prime_composer.trainer.losses.aggregate import metric_pair

_LOG_FLOOR = -1e30
"""Logits and log-probabilities of -inf (masked vocab entries, an empty tail) are raised to this
finite value: their probability is still exactly 0, but no inf - inf turns a value or gradient
into NaN."""

_CHUNK_ELEMENTS = 1 << 24
"""Elements per row chunk; each chunk creates a few temporaries of this size."""

_CPU_CHUNK_ELEMENTS = 1 << 19
"""Cap on a CPU: a 2 MiB fp32 chunk stays in cache across the dozen elementwise passes, and stays
below glibc's mmap threshold (a fresh mmap per temporary page-faults on every touch). Measured
~3x faster per element than 64 MiB chunks on the development machines."""


def _kl(log_p: Tensor, log_q: Tensor) -> Tensor:
    """KL(p || q) = sum p (log p - log q) over the last dim, from log-probabilities."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def generalized_jsd(student_log_probs: Tensor, teacher_log_probs: Tensor, beta: float) -> Tensor:
    """Generalized JSD between two distributions given as log-probabilities over the last dim.

    The plain, differentiable formula (``sdpo_loss`` computes the same value with a closed-form
    gradient).

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


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """[N] row-wise dot products of two [N, K] tensors, without an [N, K] product temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _jsd_and_grad(
    log_s: Tensor, log_t: Tensor, beta: float, grad_out: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Divergence [N] and KL(P_t || P_s) [N] of two finite [N, K] log-distributions; with
    ``grad_out`` ([N, K]) also writes dD/du there, u being the logits that ``log_s`` is the
    log-softmax of. ``log_s`` and ``log_t`` may be overwritten."""
    s, t = log_s.exp(), log_t.exp()
    if beta == 0.0:
        diff = log_t.sub_(log_s)  # log T - log S
        divergence = _rowdot(t, diff)
        if grad_out is not None:
            torch.sub(s, t, out=grad_out)
        return divergence, divergence
    if beta == 1.0:
        diff = log_s.sub_(log_t)  # log S - log T
        divergence = _rowdot(s, diff)
        kl_ts = -_rowdot(t, diff)
        if grad_out is not None:
            torch.mul(diff.sub_(divergence[:, None]), s, out=grad_out)
        return divergence, kl_ts
    # log M from the mixed probabilities: where both underflow to 0 the floor keeps log M finite,
    # and those entries carry weight 0 in every sum below.
    log_m = torch.lerp(s, t, beta).clamp_min_(torch.finfo(s.dtype).tiny).log_()
    s_m = log_s - log_m  # log S - log M
    t_m = torch.sub(log_t, log_m, out=log_m)  # log T - log M
    kl_sm, kl_tm = _rowdot(s, s_m), _rowdot(t, t_m)
    divergence = beta * kl_tm + (1.0 - beta) * kl_sm
    kl_ts = kl_tm - _rowdot(t, s_m)  # KL(T || S) = sum T (log T - log M) - sum T (log S - log M)
    if grad_out is not None:
        torch.mul(s_m.sub_(kl_sm[:, None]), s, out=grad_out).mul_(1.0 - beta)
    return divergence, kl_ts


def _chunk_forward(
    student: Tensor,
    teacher: Tensor,
    beta: float,
    temperature: float,
    top_k: int | None,
    grad_out: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One row chunk [n, V]: divergence, KL(P_t || P_s) over the whole vocabulary, student and
    teacher tail masses (0 without ``top_k``), all [n]; dD/d(logits / T) written to ``grad_out``."""
    dtype = grad_out.dtype if grad_out is not None else torch.promote_types(student.dtype, torch.float32)
    z_s = student.to(dtype)
    z_t = teacher.to(dtype)
    if temperature != 1.0:
        z_s, z_t = z_s / temperature, z_t / temperature
    # New tensors, never the caller's; -inf logits (masked vocab entries) get a finite floor.
    z_s = z_s.clamp(min=_LOG_FLOOR)
    z_t = z_t.clamp(min=_LOG_FLOOR)
    if top_k is None:
        divergence, kl_ts = _jsd_and_grad(z_s.log_softmax(-1), z_t.log_softmax(-1), beta, grad_out)
        no_tail = divergence.new_zeros(divergence.shape)
        return divergence, kl_ts, no_tail, no_tail

    lse_s, lse_t = z_s.logsumexp(-1, keepdim=True), z_t.logsumexp(-1, keepdim=True)
    index = z_s.topk(min(top_k, z_s.shape[-1]), dim=-1).indices
    outside_s = z_s.scatter(-1, index, _LOG_FLOOR)
    outside_t = z_t.scatter(-1, index, _LOG_FLOOR)
    tail_s, tail_t = outside_s.logsumexp(-1, keepdim=True), outside_t.logsumexp(-1, keepdim=True)
    bucket_s = torch.cat([z_s.gather(-1, index), tail_s], dim=-1).sub_(lse_s).clamp_(min=_LOG_FLOOR)
    bucket_t = torch.cat([z_t.gather(-1, index), tail_t], dim=-1).sub_(lse_t).clamp_(min=_LOG_FLOOR)
    student_tail, teacher_tail = bucket_s[:, -1].exp(), bucket_t[:, -1].exp()
    bucket_grad = torch.empty_like(bucket_s) if grad_out is not None else None
    divergence, _ = _jsd_and_grad(bucket_s, bucket_t, beta, bucket_grad)
    if grad_out is not None and bucket_grad is not None:
        # The tail logit is logsumexp(outside): each outside logit gets its softmax share within the
        # tail; the top-k logits get their own bucket's gradient.
        torch.mul(outside_s.sub_(tail_s).exp_(), bucket_grad[:, -1:], out=grad_out)
        grad_out.scatter_(-1, index, bucket_grad[:, :-1])
    # The logged KL(P_t || P_s) is over the whole vocabulary: sum P_t (z_t - z_s) - lse_t + lse_s.
    p_t = z_t.sub(lse_t).exp_()
    kl_ts = _rowdot(p_t, torch.sub(z_t, z_s, out=outside_t)) - (lse_t - lse_s).squeeze(-1)
    return divergence, kl_ts, student_tail, teacher_tail


def _chunk_rows(student: Tensor) -> int:
    num_elements = _CHUNK_ELEMENTS
    if student.device.type == "cpu":
        num_elements = min(num_elements, _CPU_CHUNK_ELEMENTS)
    return max(1, num_elements // max(1, student.shape[-1]))


class _GeneralizedJSD(torch.autograd.Function):
    """Per-row divergence of [N, V] logits with its closed-form gradient (see the module docstring).

    Returns ``(divergence, kl_teacher_student, student_tail, teacher_tail)``, each [N]; only the
    divergence is differentiable, and only with respect to the student logits.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        student: Tensor,
        teacher: Tensor,
        beta: float,
        temperature: float,
        top_k: int | None,
        wants_grad: bool,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        dtype = torch.promote_types(student.dtype, torch.float32)  # float64 stays float64 (tests)
        # The [N, V] gradient buffer only when a backward can follow.
        grad = torch.empty(student.shape, dtype=dtype, device=student.device) if wants_grad else None
        parts = []
        step = _chunk_rows(student)
        for start in range(0, student.shape[0], step):
            rows = slice(start, start + step)
            chunk_grad = grad[rows] if grad is not None else None
            parts.append(_chunk_forward(student[rows], teacher[rows], beta, temperature, top_k, chunk_grad))
        outputs = tuple(torch.cat(p) for p in zip(*parts, strict=True))
        ctx.save_for_backward(grad)
        ctx.temperature = temperature
        ctx.student_dtype = student.dtype
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs  # type: ignore[return-value]

    @staticmethod
    def backward(
        ctx: Any, grad_divergence: Tensor, *_: Any
    ) -> tuple[Tensor | None, None, None, None, None, None]:
        (grad,) = ctx.saved_tensors
        if grad is None:
            return None, None, None, None, None, None
        scale = grad_divergence.to(grad.dtype)[:, None] / ctx.temperature  # d(logits / T) / d logits
        return (grad * scale).to(ctx.student_dtype), None, None, None, None, None


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
        ``(loss, metrics)`` as ``sdpo_loss_rows`` returns them for the masked positions.
    """
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
    return sdpo_loss_rows(student_logits[mask], teacher_logits.detach()[mask], cfg, temperature, normalizer)


def sdpo_loss_rows(
    student: Tensor,
    teacher: Tensor,
    cfg: SDPOLossConfig,
    temperature: float,
    normalizer: float | Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``sdpo_loss`` for logits already taken at the SDPO tokens: ``student`` and ``teacher`` are
    ``[N, V]``, row n of both predicting the same token (no copy by a mask).

    Returns:
        ``(loss, metrics)``: ``loss`` = sum over the N rows of the (clipped) per-token divergence /
        ``normalizer``, a scalar attached to the student's graph (0 with zero gradient for N = 0).
        ``metrics`` (``[sum, count]`` pairs over the rows): ``sdpo/divergence`` (before the clip),
        ``sdpo/kl_teacher_student`` (KL(P_t || P_s) over the whole vocabulary, whatever beta and
        top_k), ``sdpo/clip_frac`` (with ``token_clip``), ``sdpo/student_tail_mass`` and
        ``sdpo/teacher_tail_mass`` (with ``top_k``).
    """
    if not temperature > 0:
        raise ValueError(f"sdpo_loss: temperature must be > 0 (the sampling temperature), got {temperature}")
    if student.ndim != 2 or student.shape != teacher.shape:
        raise ValueError(
            f"sdpo_loss_rows: student {tuple(student.shape)} and teacher {tuple(teacher.shape)} logits "
            "must both be [N, V]"
        )
    num_rows = student.shape[0]
    if num_rows > 0:
        # Inside Function.forward grad mode is always off and needs_input_grad only looks at
        # requires_grad, so whether a backward can come is decided here, from the caller's mode.
        wants_grad = torch.is_grad_enabled() and student.requires_grad
        divergence, kl_ts, student_tail, teacher_tail = _GeneralizedJSD.apply(
            student, teacher.detach(), cfg.beta, float(temperature), cfg.top_k, wants_grad
        )
    else:
        # Empty: a zero that is still attached to the student, so backward gives zero grads.
        divergence = student.to(torch.promote_types(student.dtype, torch.float32)).sum(-1)
        kl_ts = student_tail = teacher_tail = divergence.detach()

    per_token = divergence
    if cfg.token_clip is not None:
        per_token = divergence.clamp(max=cfg.token_clip)  # no gradient through clipped tokens
    denominator = torch.as_tensor(normalizer, dtype=per_token.dtype, device=per_token.device)
    loss = per_token.sum() / torch.where(denominator > 0, denominator, 1.0)

    with torch.no_grad():
        metrics = {
            "sdpo/divergence": metric_pair(divergence.sum(), num_rows),
            "sdpo/kl_teacher_student": metric_pair(kl_ts.sum(), num_rows),
        }
        if cfg.token_clip is not None:
            metrics["sdpo/clip_frac"] = metric_pair((divergence > cfg.token_clip).sum(), num_rows)
        if cfg.top_k is not None:
            metrics["sdpo/student_tail_mass"] = metric_pair(student_tail.sum(), num_rows)
            metrics["sdpo/teacher_tail_mass"] = metric_pair(teacher_tail.sum(), num_rows)
    return loss, metrics

"""Per-token log-probabilities and entropies from logits, without a full fp32 copy of the logits.

Shift convention (used by every function here that takes ``input_ids``): outputs are aligned with
the tokens, not with the logits. ``out[b, t]`` is the log-probability of ``input_ids[b, t]`` given
the tokens before it, read from ``logits[b, t - 1]``; ``out[b, 0]`` is 0 because nothing predicts
the first token (its loss mask must be 0). So the inference logprobs, advantages and loss masks of
a batch, which are all per token, line up with the output index for index.

Memory: a plain ``log_softmax(logits.float() / T)`` keeps a [B, T, V] fp32 tensor for backward
(2x the bf16 logits, and V is ~150k for current tokenizers). ``token_logprobs`` instead walks the
rows in chunks in both passes and keeps only the logits (already alive) and one logsumexp per row;
the backward recomputes the softmax chunk by chunk.
"""

from __future__ import annotations

import torch
from torch import Tensor

_CHUNK_ELEMENTS = 1 << 25
"""fp32 elements materialized at once per chunk (128 MiB); bounds the working memory."""


def _chunk_rows(num_vocab: int) -> int:
    return max(1, _CHUNK_ELEMENTS // num_vocab)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for bf16/fp16/fp32 logits; float64 stays float64 (exact checks in tests)."""
    return torch.promote_types(dtype, torch.float32)


class _GatherLogprob(torch.autograd.Function):
    """``log_softmax(logits / T)[i, targets[i]]`` for 2-D logits, chunked over rows."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float) -> Tensor:  # type: ignore[override]
        num_rows = logits.shape[0]
        dtype = _compute_dtype(logits.dtype)
        out = torch.empty(num_rows, dtype=dtype, device=logits.device)
        lse = torch.empty(num_rows, dtype=dtype, device=logits.device)
        step = _chunk_rows(logits.shape[1])
        for start in range(0, num_rows, step):
            x = logits[start : start + step].to(dtype) / temperature
            lse_chunk = torch.logsumexp(x, dim=-1)
            picked = x.gather(-1, targets[start : start + step, None]).squeeze(-1)
            out[start : start + step] = picked - lse_chunk
            lse[start : start + step] = lse_chunk
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        logits, targets, lse = ctx.saved_tensors
        temperature = ctx.temperature
        grad = torch.empty_like(logits)
        step = _chunk_rows(logits.shape[1])
        for start in range(0, logits.shape[0], step):
            rows = slice(start, start + step)
            g = grad_out[rows].to(lse.dtype)[:, None]
            # d logp(y) / d z_j = (1[j == y] - softmax_j) / T
            probs = torch.exp(logits[rows].to(lse.dtype) / temperature - lse[rows, None])
            chunk = probs.mul_(-g)
            chunk.scatter_add_(-1, targets[rows, None], g)
            grad[rows] = chunk.div_(temperature)
        return grad, None, None


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (the sampling temperature), got {temperature}")


def gather_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probability of ``targets`` under ``softmax(logits / temperature)``, no shift.

    Args:
        logits: [N, V], any float dtype; differentiable.
        targets: [N] token ids.
        temperature: the sampling temperature (> 0).

    Returns:
        [N] log-probabilities, float32 (float64 for float64 logits).
    """
    _check_temperature(temperature)
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"gather_logprobs expects logits [N, V] and targets [N], got {logits.shape} and {targets.shape}"
        )
    return _GatherLogprob.apply(logits.contiguous(), targets.long().contiguous(), float(temperature))


def token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probability of each token of ``input_ids`` given its prefix (see the module's shift convention).

    Args:
        logits: [B, T, V] model output for ``input_ids`` (bf16 or fp32); differentiable.
        input_ids: [B, T] the tokens the logits were computed on.
        temperature: the sampling temperature (> 0); the logits are divided by it, as the inference
            server did, so the result is comparable with its logprobs.

    Returns:
        [B, T] float32 (float64 for float64 logits); ``out[:, t] = log softmax(logits[:, t - 1] / temperature)[input_ids[:, t]]``
        for ``t >= 1`` and ``out[:, 0] = 0``.
    """
    if logits.dim() != 3 or input_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"token_logprobs expects logits [B, T, V] and input_ids [B, T], got {logits.shape} and {input_ids.shape}"
        )
    batch, seq_len, num_vocab = logits.shape
    # Score every logits row against the next token (a dummy 0 for the last row, whose result is
    # dropped): this keeps the logits a view instead of copying logits[:, :-1].
    next_ids = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)
    per_row = gather_logprobs(logits.reshape(batch * seq_len, num_vocab), next_ids.reshape(-1), temperature)
    per_row = per_row.view(batch, seq_len)
    return torch.cat([per_row.new_zeros(batch, 1), per_row[:, :-1]], dim=1)


@torch.no_grad()
def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` over the last dim, no shift; a detached metric.

    Args:
        logits: [..., V].
        temperature: the sampling temperature (> 0).

    Returns:
        [...] entropies in nats (float32, or float64 for float64 logits), detached (for logging, not for a loss).
    """
    _check_temperature(temperature)
    flat = logits.reshape(-1, logits.shape[-1])
    dtype = _compute_dtype(logits.dtype)
    out = torch.empty(flat.shape[0], dtype=dtype, device=logits.device)
    step = _chunk_rows(flat.shape[1])
    for start in range(0, flat.shape[0], step):
        x = flat[start : start + step].to(dtype) / temperature
        probs = torch.softmax(x, dim=-1)
        # p * log p is 0 where p is 0 (logits of -inf), not NaN.
        out[start : start + step] = -torch.special.xlogy(probs, probs).sum(-1)
    return out.view(logits.shape[:-1])


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of the distribution each token was sampled from, aligned like ``token_logprobs``.

    Args:
        logits: [B, T, V].
        temperature: the sampling temperature (> 0).

    Returns:
        [B, T] float32, detached; ``out[:, t]`` is the entropy of ``logits[:, t - 1]``, ``out[:, 0] = 0``.
    """
    per_row = entropy_from_logits(logits, temperature)
    return torch.cat([per_row.new_zeros(per_row.shape[0], 1), per_row[:, :-1]], dim=1)

"""The RL term: clipped importance-weighted policy gradient against the inference logprobs.

Per loss token t with advantage A_t and importance ratio r_t = pi_trainer(y_t) / pi_inference(y_t)
(both after the sampling temperature):

    l_t = -min(r_t * A_t, clip(r_t, 1 - eps_low, 1 + eps_high) * A_t)  [* 0 if r_t is extreme]
          + kl_coef * k3_t,     k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1

and the micro-batch returns ``sum_t w_t * l_t / normalizer`` with the global ``normalizer`` from
``aggregate.rl_normalizer`` (w_t = 1, or 1 / tokens-of-its-sequence for ``sequence_mean``).

``sequence_mean`` counts only sequences that have at least one loss token: a sequence whose tokens
are all masked (e.g. only environment tokens survived truncation) adds nothing to the numerator
and nothing to the denominator. TRL's ``grpo`` divides by every row of the batch instead, so on a
batch with such a row ours is TRL's times rows / non-empty sequences (``tests/unit/test_loss_rl.py``
checks exactly that); with no empty sequence the two agree.

How it departs from textbook PPO: the "old" policy is the inference server's policy that sampled
the tokens (async RL), so the ratio also absorbs trainer/inference numerical mismatch; that is
why tokens with extreme ratios can be masked (``mask_ratio_low/high``) and why the mismatch KL is
logged. With ``ratio_level = "sequence"`` (GSPO) r is the geometric mean of the token ratios of
the sequence, shared by its tokens. The ratio is 1 on the first pass of a fully on-policy step,
so the gradient is then ``-A_t * grad logp_t / normalizer`` (the REINFORCE / GRPO gradient).
"""

from __future__ import annotations

import torch
from torch import Tensor

from prime_composer.config.loss import RLLossConfig
from prime_composer.trainer.losses.aggregate import metric_pair, segment_index


def _k3(log_ratio: Tensor) -> Tensor:
    """k3 estimator exp(x) - x - 1 of KL(q || p) for x = log p(y) - log q(y), y ~ q (>= 0, unbiased)."""
    return torch.expm1(log_ratio) - log_ratio


def _check_shapes(logprobs: Tensor, **others: Tensor | None) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"rl_loss: logprobs must be [B, T], got {tuple(logprobs.shape)}")
    for name, tensor in others.items():
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(
                f"rl_loss: {name} {tuple(tensor.shape)} must match logprobs {tuple(logprobs.shape)}"
            )


def rl_loss(
    logprobs: Tensor,
    inference_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cfg: RLLossConfig,
    normalizer: float | Tensor,
    *,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    segment_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """One micro-batch's share of the step's RL loss.

    Args:
        logprobs: [B, T] trainer log-probabilities of the sampled tokens (after temperature, e.g.
            ``token_logprobs``); the only input that carries gradient.
        inference_logprobs: [B, T] log-probabilities the inference server reported for the same
            tokens at the same temperature; treated as constants.
        advantages: [B] per row or [B, T] per token (packed rows need per token).
        loss_mask: [B, T] bool or 0/1: tokens the policy generated (prompt, tool output, padding 0).
        cfg: the ``loss.rl`` section.
        normalizer: the step's global denominator from ``aggregate.rl_normalizer`` for
            ``cfg.aggregation`` (loss tokens, sequences, or the configured constant; all
            micro-batches and ranks). 0 (nothing to train on anywhere) gives a loss of 0.
        ref_logprobs: [B, T] reference-model log-probabilities; required iff ``cfg.kl_coef > 0``.
        entropy: [B, T] optional per-token entropies (``token_entropy``), only logged.
        segment_ids: [B, T] sequence ids when several sequences are packed in a row (see
            ``aggregate.segment_index``); None = one sequence per row. Used by
            ``ratio_level = "sequence"`` and ``aggregation = "sequence_mean"``.

    Returns:
        ``(loss, metrics)``: ``loss`` is a scalar, ``sum_t w_t * l_t / normalizer``; the sum of the
        losses of all micro-batches (and ranks) is the step's loss, so ``loss.backward()`` per
        micro-batch accumulates the step's gradient. ``metrics`` maps names to ``[sum, count]``
        pairs over this micro-batch's loss tokens (reduce with ``aggregate.finalize_metrics``):
        ``rl/ratio`` mean importance ratio (at ``ratio_level``); ``rl/clip_low_frac`` and
        ``rl/clip_high_frac`` fractions where the clip binds (ratio < 1 - eps_low with A < 0,
        ratio > 1 + eps_high with A > 0); ``rl/masked_frac`` fraction masked for an extreme
        ratio; ``rl/mismatch_kl`` the k3 estimate of KL(inference || trainer) from the token
        log-ratios (it also includes the policy's drift after the first optimizer step on the
        batch); ``rl/kl_ref`` the k3 estimate of KL(trainer || reference) when ``kl_coef > 0``;
        ``rl/entropy`` when ``entropy`` is given.
    """
    _check_shapes(
        logprobs,
        inference_logprobs=inference_logprobs,
        loss_mask=loss_mask,
        ref_logprobs=ref_logprobs,
        entropy=entropy,
    )
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("rl_loss: loss.rl.kl_coef > 0 needs ref_logprobs (run the reference model forward)")
    if cfg.kl_coef == 0 and ref_logprobs is not None:
        raise ValueError("rl_loss: ref_logprobs given but loss.rl.kl_coef = 0; skip the reference forward")
    batch, seq_len = logprobs.shape
    mask = loss_mask.bool()
    # fp32 math for bf16 inputs; float64 stays float64 (exact checks in tests).
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    weight = mask.to(dtype)
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    advantages = advantages.to(dtype).expand(batch, seq_len)

    # Outside the mask the log-probs may be anything (position 0, padding): zero them so exp()
    # cannot overflow into a NaN gradient.
    token_log_ratio = torch.where(mask, logprobs.to(dtype) - inference_logprobs.detach().to(dtype), 0.0)
    index = segment_index(loss_mask, segment_ids)
    tokens_per_seq = weight.new_zeros(batch * seq_len).index_add_(0, index, weight.reshape(-1))

    if cfg.ratio_level == "token":
        log_ratio = token_log_ratio
    else:
        seq_sum = torch.zeros_like(tokens_per_seq).index_add(0, index, token_log_ratio.reshape(-1))
        seq_mean = seq_sum / tokens_per_seq.clamp(min=1.0)
        log_ratio = seq_mean[index].view(batch, seq_len)
    ratio = torch.exp(log_ratio)

    clipped = torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)

    keep = torch.ones_like(mask)
    if cfg.mask_ratio_low is not None:
        keep &= ratio.detach() >= cfg.mask_ratio_low
    if cfg.mask_ratio_high is not None:
        keep &= ratio.detach() <= cfg.mask_ratio_high
    per_token = per_token * keep

    if ref_logprobs is not None:
        ref_kl = _k3(torch.where(mask, ref_logprobs.detach().to(dtype) - logprobs.to(dtype), 0.0))
        per_token = per_token + cfg.kl_coef * ref_kl

    per_token = per_token * weight
    if cfg.aggregation == "sequence_mean":
        seq_loss = torch.zeros_like(tokens_per_seq).index_add(0, index, per_token.reshape(-1))
        total = (seq_loss / tokens_per_seq.clamp(min=1.0)).sum()
    else:
        total = per_token.sum()
    denominator = torch.as_tensor(normalizer, dtype=dtype, device=total.device)
    # A zero denominator means no loss token in the whole step: every sum is 0, keep it 0.
    loss = total / torch.where(denominator > 0, denominator, 1.0)

    num_tokens = weight.sum()
    with torch.no_grad():
        metrics = {
            "rl/ratio": metric_pair((ratio * weight).sum(), num_tokens),
            "rl/clip_low_frac": metric_pair(
                ((ratio < 1.0 - cfg.eps_low) & (advantages < 0) & mask).sum(), num_tokens
            ),
            "rl/clip_high_frac": metric_pair(
                ((ratio > 1.0 + cfg.eps_high) & (advantages > 0) & mask).sum(), num_tokens
            ),
            "rl/masked_frac": metric_pair((~keep & mask).sum(), num_tokens),
            "rl/mismatch_kl": metric_pair((_k3(token_log_ratio) * weight).sum(), num_tokens),
        }
        if ref_logprobs is not None:
            metrics["rl/kl_ref"] = metric_pair((ref_kl * weight).sum(), num_tokens)
        if entropy is not None:
            metrics["rl/entropy"] = metric_pair((entropy.to(dtype) * weight).sum(), num_tokens)
    return loss, metrics

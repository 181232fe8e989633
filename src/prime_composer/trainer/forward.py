"""Forward a Hugging Face causal LM on packed rows, without full-vocabulary logits.

Several samples share a row (see ``orchestrator/packing.py``); they must not attend to each
other. We rely on transformers (5.x) for that instead of building a ``[R, T, T]`` mask: when a
model is called with ``position_ids``, no ``attention_mask`` and no KV cache, its mask code
(``masking_utils.find_packed_sequence_indices``) starts a new sequence wherever the position
does not go up by one, and makes the causal mask block-diagonal (sdpa, eager, flex) or passes
the boundaries to the varlen kernels (flash attention). ``use_cache=False`` matters: with a
cache the detection is skipped. ``tests/unit/test_forward_packed.py`` checks that packed and
one-by-one forwards agree, and that they do not without restarting positions.

Lean logits: the output head would turn ``[R, T, H]`` hidden states into ``[R, T, V]`` logits, and
with V = 152k at T = 8k that one fp32 tensor is 5 GB per row, before the copies a log-softmax and
its backward make. So a pre-hook on the head hands it no position at all (the model's own output
is then an empty ``[R, 0, V]``: no head matmul that nothing reads) and a forward hook, still inside the model's forward (FSDP has the head's
parameters gathered), computes only what the loss terms read:

- the log-probability of every loss token, chunk by chunk over the tokens, by a custom autograd
  function that keeps one logsumexp per token and, when the ``[N, V]`` probabilities fit in
  ``KEEP_ELEMENTS``, those too (a plain cross-entropy keeps as much), or else recomputes each
  chunk's logits in backward (``_HeadLogprobs``; the head's weight and bias get their gradients
  from it);
- the entropy of those tokens, in the same chunks, detached (it is only logged);
- full logits ``[N, V]`` only at the positions a term asked for (SDPO's target tokens): taken from
  the same chunks when they are all loss tokens, so the head runs once for both and the term's
  logit gradient joins the logprobs' before the backward matmuls; other positions get a head
  pass of their own.

Outputs are aligned with ``input_ids`` like every ``MicroBatch`` tensor: the value at ``t`` is
about token ``t``, computed from the hidden state at ``t - 1``. Tokens outside the loss mask get
logprob 0 and entropy 0. Models that transform logits after the head (soft-capping, scaling) are
refused: the lean path would skip the transform.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from prime_composer.transport.batch import MicroBatch

PACKING_AWARE_ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
"""Attention implementations whose transformers mask code separates packed samples."""

CHUNK_ELEMENTS = 1 << 24
"""fp32 logits materialized at once (64 MiB): the chunk size of the head's passes is this / V."""

KEEP_ELEMENTS = 1 << 26
"""Up to this many ``[N, V]`` probabilities (256 MiB in fp32) the head keeps them for backward
instead of recomputing its logits there; the 8k-token, 152k-vocabulary case stays lean."""

POST_HEAD_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier")
"""Config attributes of architectures that change logits after the head (Gemma 2/3, Cohere, Granite,
Falcon-H1); the lean head path does not apply them."""


@dataclass
class ForwardOutput:
    """What one forward of the policy on a micro-batch's core rows gives the loss terms."""

    logprobs: torch.Tensor
    """``[R, T]`` float32 (float64 for a float64 model) log-probability of each loss token at the
    batch's temperature (0 on other tokens); carries gradient."""
    entropy: torch.Tensor
    """``[R, T]`` float32 entropy of the distribution each loss token was sampled from (0 elsewhere);
    detached, only logged."""
    logits: dict[str, torch.Tensor] = field(default_factory=dict)
    """Full temperature-scaled float32 logits ``[N, V]`` a term asked for (``logits_masks``), by
    name, row-major over that term's mask; carry gradient."""


def check_model(model: nn.Module) -> nn.Linear:
    """The model's output head, after checking the model can run the packed lean forward."""
    config = model.config
    attention = getattr(config, "_attn_implementation", None)
    if attention not in PACKING_AWARE_ATTENTION:
        raise ValueError(
            f"attention implementation {attention!r} is not known to separate packed samples; "
            f"load the model with attn_implementation set to one of {PACKING_AWARE_ATTENTION}"
        )
    for name in POST_HEAD_TRANSFORMS:
        value = getattr(config, name, None)
        if value not in (None, 0, 0.0, 1, 1.0):
            raise ValueError(
                f"{type(model).__name__} transforms its logits after the output head (config.{name} = "
                f"{value}), which the trainer's chunked head does not apply yet"
            )
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"{type(model).__name__}'s output head is {type(head).__name__}, not an nn.Linear: the "
            "trainer's chunked head needs a plain linear output layer"
        )
    return head


def forward_micro_batch(
    model: nn.Module,
    mb: MicroBatch,
    *,
    logits_masks: dict[str, torch.Tensor] | None = None,
    entropy: bool = True,
) -> ForwardOutput:
    """Forward ``model`` on ``mb``'s core rows at ``mb.temperature``, scoring its loss tokens.

    ``logits_masks`` maps a name to an ``[R, T]`` bool mask of the tokens whose whole predicting
    distribution that term needs. ``entropy = False`` skips the entropies (all 0). Gradients flow
    unless the caller runs it under ``torch.no_grad()``.
    """
    return forward_rows(
        model,
        mb.input_ids,
        mb.position_ids,
        mb.loss_mask,
        mb.temperature,
        logits_masks=logits_masks,
        entropy=entropy,
    )


def forward_rows(
    model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    scored: torch.Tensor,
    temperature: float,
    *,
    logits_masks: dict[str, torch.Tensor] | None = None,
    entropy: bool = True,
) -> ForwardOutput:
    """Forward ``model`` on packed rows ``[R, T]`` (see the module docstring) and return the
    log-probabilities (and entropies) of the ``scored`` tokens at ``temperature``; any term's own
    rows (e.g. the replay pairs) go through here too."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 to score tokens, got {temperature}")
    head = check_model(model)
    device = head.weight.device
    input_ids = input_ids.to(device)
    position_ids = position_ids.to(device)
    # Nothing in a row predicts a sample's first token.
    scored = scored.to(device) & (position_ids != 0)
    masks = {name: m.to(device) & (position_ids != 0) for name, m in (logits_masks or {}).items()}
    result: dict[str, Any] = {}

    def keep_one_position(_: nn.Module, args: tuple[Any, ...]) -> tuple[torch.Tensor]:
        (hidden,) = args
        if tuple(hidden.shape[:2]) != tuple(input_ids.shape):
            raise RuntimeError(
                f"expected the output head of {type(model).__name__} to get [R, T, H] hidden states for "
                f"[R, T] = {tuple(input_ids.shape)}, got {tuple(hidden.shape)}"
            )
        result["hidden"] = hidden
        return (hidden[:, :0],)

    def score(_: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        hidden = result.pop("hidden")
        rows, cols = scored.nonzero(as_tuple=True)
        # A term's logits rows that are all loss tokens come out of the logprobs' own chunks (one
        # head matmul and one backward pair for both); others get a head pass of their own.
        slot = torch.cumsum(scored.reshape(-1), 0).sub_(1)
        shared = {name: slot[m.reshape(-1)] for name, m in masks.items() if not bool((m & ~scored).any())}
        logprobs, entropies, shared_logits = head_logprobs(
            hidden[rows, cols - 1],
            head,
            input_ids[rows, cols],
            temperature,
            entropy,
            torch.cat(list(shared.values())) if shared else None,
        )
        result["logprobs"] = logprobs.new_zeros(scored.shape).index_put((rows, cols), logprobs)
        result["entropy"] = entropies.new_zeros(scored.shape).index_put((rows, cols), entropies)
        picked = dict(zip(shared, shared_logits.split([len(i) for i in shared.values()]), strict=True))
        for name, mask in masks.items():
            if name in shared:
                continue
            r, c = mask.nonzero(as_tuple=True)
            logits = F.linear(hidden[r, c - 1], head.weight, head.bias)
            picked[name] = logits.to(_compute_dtype(logits.dtype)) / temperature
        result["logits"] = {name: picked[name] for name in masks}

    pre = head.register_forward_pre_hook(keep_one_position)
    post = head.register_forward_hook(score)
    try:
        model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    finally:
        pre.remove()
        post.remove()
    return ForwardOutput(logprobs=result["logprobs"], entropy=result["entropy"], logits=result["logits"])


def head_logprobs(
    hidden: torch.Tensor,
    head: nn.Linear,
    targets: torch.Tensor,
    temperature: float,
    entropy: bool = True,
    logits_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``log_softmax(head(hidden) / T)[targets]`` and the entropies of those distributions, chunked.

    Args:
        hidden: ``[N, H]`` hidden states (differentiable).
        head: the output layer; its weight (and bias) receive gradients.
        targets: ``[N]`` token ids.
        temperature: the sampling temperature (> 0).
        entropy: also compute the (detached) entropies; zeros otherwise.
        logits_rows: ``[M]`` indices into the N rows whose whole logits the caller also wants.

    Returns:
        ``([N] float32 logprobs, [N] float32 entropies, [M, V] float32 logits / T)``; the logits
        carry gradient (it joins the logprobs' in the same backward matmuls).
    """
    weight, bias = head.weight, head.bias
    chunk = max(1, CHUNK_ELEMENTS // weight.shape[0])
    if logits_rows is None:
        logits_rows = torch.zeros(0, dtype=torch.long, device=hidden.device)
    return _HeadLogprobs.apply(hidden, weight, bias, targets, float(temperature), chunk, entropy, logits_rows)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for bf16/fp16/fp32 weights; float64 stays float64 (exact checks in tests)."""
    return torch.promote_types(dtype, torch.float32)


class _HeadLogprobs(torch.autograd.Function):
    """Logprobs of ``targets`` under ``F.linear(hidden, weight, bias) / T`` without keeping logits.

    When the ``[N, V]`` probabilities fit in ``KEEP_ELEMENTS`` the forward keeps them and the
    backward reads them instead of recomputing each chunk's logits (one head matmul and one
    exponential fewer, the price of a plain cross-entropy's saved log-softmax); above it, nothing
    ``[N, V]`` survives the forward. Both backwards compute the same numbers in the same order.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk: int,
        entropy: bool,
        logits_rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num = hidden.shape[0]
        dtype = _compute_dtype(weight.dtype)
        # Where each chunk's rows go in the [M, V] logits output (sorted, so a chunk's are a slice).
        order = torch.argsort(logits_rows, stable=True)
        wanted = logits_rows[order]
        bounds = torch.searchsorted(
            wanted, torch.arange(0, num + chunk, chunk, device=wanted.device)
        ).tolist()
        sub = torch.empty((len(logits_rows), weight.shape[0]), dtype=dtype, device=hidden.device)
        out = torch.empty(num, dtype=dtype, device=hidden.device)
        lse = torch.empty(num, dtype=dtype, device=hidden.device)
        ent = torch.zeros(num, dtype=dtype, device=hidden.device)
        keep = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        probs = (
            torch.empty((num, weight.shape[0]), dtype=dtype, device=hidden.device)
            if keep and num * weight.shape[0] <= KEEP_ELEMENTS
            else None
        )
        for start in range(0, num, chunk):
            rows = slice(start, start + chunk)
            logits = F.linear(hidden[rows], weight, bias).to(dtype)
            if temperature != 1.0:
                logits = logits / temperature
            index = slice(bounds[start // chunk], bounds[start // chunk + 1])
            if index.stop > index.start:
                sub[order[index]] = logits[wanted[index] - start]
            lse_chunk = logits.logsumexp(-1)
            out[rows] = logits.gather(-1, targets[rows, None]).squeeze(-1) - lse_chunk
            lse[rows] = lse_chunk
            if entropy or probs is not None:
                log_probs = logits.sub_(lse_chunk[:, None])
                p = torch.exp(log_probs, out=probs[rows]) if probs is not None else log_probs.exp()
                if entropy:
                    # H = -sum p log p; p * log p is 0 where p is 0 (a logit of -inf), not NaN. In
                    # place on the chunk's scratch logits: two passes and no temporary (a batched
                    # row dot, bmm of [N, 1, V] x [N, V, 1], measured 2-3x slower on a CPU).
                    ent[rows] = log_probs.clamp_(min=torch.finfo(dtype).min).mul_(p).sum(-1).neg_()
        ctx.save_for_backward(hidden, weight, bias, targets, lse, probs, order, wanted)
        ctx.temperature, ctx.chunk, ctx.bounds = temperature, chunk, bounds
        ctx.mark_non_differentiable(ent)
        return out, ent, sub

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_out: torch.Tensor, _grad_ent: torch.Tensor, grad_sub: torch.Tensor
    ) -> tuple[Any, ...]:
        hidden, weight, bias, targets, lse, probs, order, wanted = ctx.saved_tensors
        temperature, chunk, bounds = ctx.temperature, ctx.chunk, ctx.bounds
        dtype = lse.dtype
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=dtype) if ctx.needs_input_grad[1] else None
        grad_bias = (
            torch.zeros_like(bias, dtype=dtype) if bias is not None and ctx.needs_input_grad[2] else None
        )
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            g = grad_out[rows].to(dtype)[:, None]
            if probs is not None:
                softmax = probs[rows]
            else:
                logits = F.linear(hidden[rows], weight, bias).to(dtype)
                if temperature != 1.0:
                    logits = logits / temperature
                softmax = torch.exp(logits - lse[rows, None])
            # d logp(y) / d z_j = (1[j == y] - softmax_j) / T, times the incoming gradient.
            grad_logits = softmax.mul_(-g)
            grad_logits.scatter_add_(-1, targets[rows, None], g)
            index = slice(bounds[start // chunk], bounds[start // chunk + 1])
            if index.stop > index.start:
                # The wanted logits are z / T like the logprobs': their gradients add up here.
                grad_logits.index_add_(0, wanted[index] - start, grad_sub[order[index]].to(dtype))
            if temperature != 1.0:
                grad_logits.div_(temperature)
            if grad_hidden is not None:
                grad_hidden[rows] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += grad_logits.T @ hidden[rows].to(dtype)
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
            None,
            None,
        )

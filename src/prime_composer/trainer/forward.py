"""Forward a Hugging Face causal LM on packed rows and return per-token logprobs.

Several samples share a row (see ``orchestrator/packing.py``); they must not attend to each
other. We rely on transformers (5.x) for that instead of building a ``[R, T, T]`` mask: when a
model is called with ``position_ids``, no ``attention_mask`` and no KV cache, its mask code
(``masking_utils.find_packed_sequence_indices``) starts a new sequence wherever the position
does not go up by one, and makes the causal mask block-diagonal (sdpa, eager, flex) or passes
the boundaries to the varlen kernels (flash attention). ``use_cache=False`` matters: with a
cache the detection is skipped. ``tests/unit/test_forward_packed.py`` checks that packed and
one-by-one forwards agree, and that they do not without restarting positions.

Outputs are aligned with ``input_ids`` like every ``MicroBatch`` tensor: the value at ``t`` is
about token ``t``, computed from the logits at ``t - 1``. The first token of every sample has no
prediction (value 0) and is never in ``loss_mask``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from prime_composer.trainer.losses.logprobs import entropy_from_logits
from prime_composer.transport.batch import MicroBatch

PACKING_AWARE_ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
"""Attention implementations whose transformers mask code separates packed samples."""


@dataclass
class ForwardOutput:
    """What one forward of the policy on a micro-batch's core rows gives the loss terms.

    Every tensor is aligned with the tokens: position ``t`` is about token ``t``, predicted from the
    model's output at ``t - 1``; the first token of every packed sample has no prediction.
    """

    logprobs: torch.Tensor
    """``[R, T]`` float32 log-probability of each token at the batch's temperature (0 at sample
    starts); carries gradient."""
    entropy: torch.Tensor
    """``[R, T]`` float32 entropy of the distribution each token was sampled from, on the loss tokens
    only (0 elsewhere); detached, only logged."""
    logits: dict[str, torch.Tensor] = field(default_factory=dict)
    """Full temperature-scaled float32 logits ``[N, V]`` a term asked for (``logits_masks``), by
    name, row-major over that term's mask; carry gradient."""


def _check_packing_aware(model: nn.Module) -> None:
    attention = getattr(model.config, "_attn_implementation", None)
    if attention not in PACKING_AWARE_ATTENTION:
        raise ValueError(
            f"attention implementation {attention!r} is not known to separate packed samples; "
            f"load the model with attn_implementation set to one of {PACKING_AWARE_ATTENTION}"
        )


def forward_micro_batch(
    model: nn.Module,
    mb: MicroBatch,
    *,
    logits_masks: dict[str, torch.Tensor] | None = None,
    entropy: bool = True,
) -> ForwardOutput:
    """Forward ``model`` on ``mb``'s core rows at ``mb.temperature``.

    ``logits_masks`` maps a name to an ``[R, T]`` bool mask of the tokens whose whole predicting
    distribution that term needs (e.g. SDPO's target tokens). ``entropy = False`` skips the
    entropies (all 0). Gradients flow unless the caller runs it under ``torch.no_grad()``.
    """
    logprobs, logits = packed_token_logprobs(model, mb, mb.temperature, return_logits=True)
    assert logits is not None
    entropies = torch.zeros_like(logprobs, dtype=torch.float32)
    if entropy:
        loss_mask = mb.loss_mask.to(logits.device)
        # logits[:, t] is the distribution token t was sampled from.
        entropies[loss_mask] = entropy_from_logits(logits.detach()[loss_mask]).float()
    picked = {name: logits[mask.to(logits.device)] for name, mask in (logits_masks or {}).items()}
    return ForwardOutput(logprobs=logprobs, entropy=entropies, logits=picked)


def packed_token_logprobs(
    model: nn.Module, mb: MicroBatch, temperature: float, return_logits: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token logprobs ``[R, T]`` (float32) of ``mb.input_ids`` under ``model / temperature``.

    With ``return_logits`` also returns the temperature-scaled float32 logits ``[R, T, V]``,
    aligned the same way (``logits[:, t]`` is the distribution token ``t`` was predicted from;
    zeros at sample starts), for losses that need whole distributions. Gradients flow through
    both unless the caller runs it under ``torch.no_grad()``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score tokens, got {temperature}")
    _check_packing_aware(model)
    device = next(model.parameters()).device
    input_ids = mb.input_ids.to(device)
    position_ids = mb.position_ids.to(device)
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits.float()
    if temperature != 1.0:
        logits = logits / temperature

    # Next-token prediction: logits at t-1 score token t.
    predicting = logits[:, :-1]
    token_logprobs = predicting.gather(-1, input_ids[:, 1:, None]).squeeze(-1) - predicting.logsumexp(-1)
    logprobs = torch.cat([token_logprobs.new_zeros(input_ids.shape[0], 1), token_logprobs], dim=1)
    sample_start = position_ids == 0  # nothing in the row predicts a sample's first token
    logprobs = logprobs.masked_fill(sample_start, 0.0)
    if not return_logits:
        return logprobs, None
    aligned = torch.cat([torch.zeros_like(logits[:, :1]), predicting], dim=1)
    return logprobs, aligned.masked_fill(sample_start[..., None], 0.0)

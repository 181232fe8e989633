"""Sampling one token per row, and the logprobs the trainer needs for exact importance ratios.

The reported logprob of a sampled token is ``log_softmax(logits / temperature)[token]`` computed in
float32 from the same logits the model returns, which is what the trainer recomputes from its own
forward pass. Two departures from a plain softmax sampler are deliberate and documented:

- ``top_p < 1`` samples from the nucleus (the smallest set of most likely tokens whose
  probability reaches ``top_p``, renormalized), but the reported logprob is the one *before* the
  nucleus truncation (after temperature). That is the quantity the trainer can recompute without
  knowing the nucleus, and it matches vLLM's processed logprobs.
- ``temperature == 0`` is greedy (argmax) and reports ``log_softmax(logits)`` (temperature 1).

Each sequence samples with its own ``torch.Generator``, so a seeded request draws the same random
numbers whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def make_generator(seed: int, choice_index: int, device: torch.device) -> torch.Generator:
    """The generator of choice ``choice_index`` of a request seeded with ``seed``.

    The two numbers are mixed through numpy's ``SeedSequence`` so choices of one request (and
    nearby seeds) get unrelated streams.
    """
    mixed = np.random.SeedSequence([seed & (2**64 - 1), choice_index]).generate_state(1, dtype=np.uint64)[0]
    generator = torch.Generator(device=device)
    generator.manual_seed(int(mixed) & (2**63 - 1))
    return generator


@dataclass
class SampledTokens:
    """One step's result for a batch of rows (plain Python values, ready to send)."""

    token_ids: list[int]
    logprobs: list[float]
    """Processed logprob of each sampled token (see the module docstring)."""
    top_logprobs: list[list[tuple[int, float]]] | None
    """Per row, the ``num_top`` most likely ``(token_id, logprob)`` of the same distribution,
    most likely first; ``None`` when no row asked for them."""


def sample_rows(
    logits: torch.Tensor,
    temperatures: list[float],
    top_ps: list[float],
    generators: list[torch.Generator],
    num_top: int,
) -> SampledTokens:
    """Sample one token for each row of ``logits`` ``[num_rows, vocab]``.

    ``temperatures``, ``top_ps`` and ``generators`` have one entry per row; ``num_top`` is the
    largest number of top logprobs any row asked for (0 for none).
    """
    logits = logits.float()
    num_rows = logits.shape[0]
    # Work is skipped, never changed, for the common cases (every row at temperature 1, no greedy
    # row): dividing by 1 and indexing every row give the same numbers, only slower.
    scales = [t if t != 0 else 1.0 for t in temperatures]
    if any(scale != 1.0 for scale in scales):
        logits = logits / torch.tensor(scales, dtype=torch.float32, device=logits.device).unsqueeze(1)
    logprobs = torch.log_softmax(logits, dim=-1)

    tokens = torch.empty(num_rows, dtype=torch.long, device=logits.device)
    greedy_rows = [i for i in range(num_rows) if temperatures[i] == 0]
    sampled_rows = [i for i in range(num_rows) if temperatures[i] != 0]
    if greedy_rows:
        index = torch.tensor(greedy_rows, device=logits.device)
        tokens[index] = logits[index].argmax(dim=-1)  # greedy rows were divided by 1: raw logits
    if sampled_rows:
        every_row = len(sampled_rows) == num_rows
        probs = (logprobs if every_row else logprobs[sampled_rows]).exp()
        row_top_p = [top_ps[i] for i in sampled_rows]
        if any(p < 1.0 for p in row_top_p):
            probs = _nucleus(probs, torch.tensor(row_top_p, dtype=torch.float32, device=logits.device))
        uniforms = torch.stack(
            [torch.rand((), generator=generators[i], device=logits.device) for i in sampled_rows]
        )
        index = torch.tensor(sampled_rows, device=logits.device)
        tokens[index] = _inverse_cdf(probs, uniforms)

    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top: list[list[tuple[int, float]]] | None = None
    if num_top > 0:
        values, indices = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)
        top = [
            list(zip(idx, val, strict=True))
            for idx, val in zip(indices.tolist(), values.tolist(), strict=True)
        ]
    return SampledTokens(token_ids=tokens.tolist(), logprobs=chosen.tolist(), top_logprobs=top)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row with probability proportional to ``probs`` (rows need not sum to 1).

    Inverse-CDF sampling: one uniform number per row (``multinomial`` draws one per vocabulary
    entry, ~2 ms per row for a 49k vocabulary on a CPU). The CDF is accumulated in float64 so
    rounding does not shift mass between tokens; ``right=True`` never lands on a zero-probability
    token.
    """
    cdf = probs.double().cumsum(dim=-1)
    targets = uniforms.double().unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero every token outside each row's nucleus (``multinomial`` renormalizes)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # Keep a token while the mass of the more likely ones is still below top_p. The most likely
    # token always survives, even for a top_p that rounds to 0 in float32 (an all-zero row
    # would make _inverse_cdf pick the last token of the vocabulary).
    keep_sorted = mass_before < top_p.unsqueeze(1)
    keep_sorted[:, 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    return probs * keep

"""How a round's validated contributions become the one pseudo-gradient of the outer step.

Every DC runs this on the committed members *in the commit's order*, from the same payloads, so
every rule below is a function of the commit alone and every DC ends with the same bits:

1. **Weights.** By default uniform (torchft, the DiLoCo paper): every member that trained on at
   least one token has weight 1, a member with ``num_tokens = 0`` (it skipped the round's steps)
   weight 0. With ``validation.token_weighting`` the weight is the token count, capped at
   ``token_weight_cap`` times the median token count of the members that trained. If no member
   trained, all weigh 1 (the zeros they sent average to zero).
2. **Norm clipping.** For each member with weight > 0, ``ref`` is the median L2 norm of the
   *other* weighted members; a norm above ``norm_clip_ratio * ref`` is scaled down to exactly
   ``norm_clip_ratio * ref`` (a member alone, or one whose ``ref`` is 0, is not clipped). One DC
   sending huge values (a finite 3e38) thus moves the model by at most ``norm_clip_ratio`` times
   a typical contribution. Norms are summed in float64 by numpy's pairwise summation over fixed
   chunks, single-threaded, so they do not depend on the machine's thread count.
3. **Aggregate.** ``mean``: the weighted average (``outer_optim.weighted_average``).
   ``trimmed_mean``: per coordinate, the ``floor(trim_fraction * n)`` largest and smallest of the
   ``n`` weighted members' values are dropped and the rest averaged uniformly, rows added in
   sorted order.

Payloads are validated before (``payload.parse_grad``: finite values, token counts in bounds),
and the exchange skips an outer step whose result is not finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import median

import numpy as np
import torch

from prime_composer.config.diloco import ValidationConfig
from prime_composer.diloco.outer_optim import weighted_average

_CHUNK = 1 << 20
"""Values per float64 partial sum of a squared norm (fixed, so the sum order is)."""


@dataclass
class Aggregate:
    grad: torch.Tensor
    weights: list[float]
    norms: list[float]
    clipped: list[int]
    """Indices (in commit order) of the members scaled down by the norm rule."""


def token_weights(tokens: list[int], cfg: ValidationConfig) -> list[float]:
    """Rule 1 above, for the members' ``num_tokens`` in commit order."""
    trained = [t for t in tokens if t > 0]
    if not trained:
        return [1.0] * len(tokens)
    if not cfg.token_weighting:
        return [1.0 if t > 0 else 0.0 for t in tokens]
    cap = cfg.token_weight_cap * float(median(trained))
    return [min(float(t), cap) if t > 0 else 0.0 for t in tokens]


def l2_norm(x: torch.Tensor) -> float:
    """The L2 norm of a flat float32 tensor, the same on every machine (see the module docstring)."""
    flat = x.detach().contiguous().view(-1).numpy()
    total = 0.0
    for start in range(0, flat.size, _CHUNK):
        chunk = flat[start : start + _CHUNK].astype(np.float64)
        total += float(np.add.reduce(chunk * chunk))
    return math.sqrt(total)


def clip_factors(norms: list[float], weights: list[float], ratio: float | None) -> list[float]:
    """Rule 2 above: the factor (1.0 or below) each member's pseudo-gradient is scaled by."""
    factors = [1.0] * len(norms)
    if ratio is None:
        return factors
    active = [i for i, w in enumerate(weights) if w > 0]
    for i in active:
        others = [norms[j] for j in active if j != i]
        if not others:
            continue
        limit = ratio * float(median(others))
        if limit > 0 and norms[i] > limit:
            factors[i] = limit / norms[i]
    return factors


def trimmed_mean(xs: list[torch.Tensor], trim_fraction: float) -> torch.Tensor:
    """Rule 3's ``trimmed_mean`` of equally shaped flat float32 tensors."""
    n = len(xs)
    k = math.floor(trim_fraction * n)
    if n - 2 * k < 1:
        k = (n - 1) // 2
    ordered = torch.sort(torch.stack(xs), dim=0, stable=True).values
    kept = n - 2 * k
    out = torch.zeros_like(xs[0], dtype=torch.float32)
    for row in range(k, n - k):
        out.add_(ordered[row], alpha=1.0 / kept)
    return out


def aggregate(tokens: list[int], grads: list[torch.Tensor], cfg: ValidationConfig) -> Aggregate:
    """The round's pseudo-gradient from its members' token counts and dequantized, validated
    pseudo-gradients, both in commit order."""
    assert grads and len(tokens) == len(grads)
    weights = token_weights(tokens, cfg)
    norms = [l2_norm(g) for g in grads]
    factors = clip_factors(norms, weights, cfg.norm_clip_ratio)
    scaled = [g if f == 1.0 else g * f for g, f in zip(grads, factors, strict=True)]
    clipped = [i for i, f in enumerate(factors) if f < 1.0]
    if cfg.aggregation == "trimmed_mean":
        active = [g for g, w in zip(scaled, weights, strict=True) if w > 0]
        grad = trimmed_mean(active, cfg.trim_fraction)
    else:
        grad = weighted_average(list(zip(weights, scaled, strict=True)))
    return Aggregate(grad, weights, norms, clipped)

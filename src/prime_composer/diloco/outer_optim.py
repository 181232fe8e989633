"""The outer optimizer: SGD with Nesterov momentum on flat float32 fragments.

For a fragment with global weights ``theta``, momentum buffer ``b`` (starts at 0) and averaged
pseudo-gradient ``g = mean_i(theta - local_i)``::

    b     <- mu * b + g
    d      = g + mu * b        (Nesterov)   or   d = b   (heavy ball)
    theta <- theta - lr * d

This is ``torch.optim.SGD(lr, momentum=mu, nesterov=...)`` with dampening 0 (whose first step sets
``b = g``, the same as ``0 * mu + g``); it is written out here so that every DC runs exactly
these float32 operations in this order on CPU and ends with the same bits.
"""

from __future__ import annotations

import torch

from prime_composer.config.diloco import OuterOptimConfig


def outer_step(
    theta: torch.Tensor, momentum: torch.Tensor, grad: torch.Tensor, cfg: OuterOptimConfig
) -> None:
    """Update ``theta`` and ``momentum`` in place with the averaged pseudo-gradient ``grad``."""
    assert theta.shape == momentum.shape == grad.shape and theta.dtype == torch.float32
    momentum.mul_(cfg.momentum).add_(grad)
    direction = grad.add(momentum, alpha=cfg.momentum) if cfg.nesterov else momentum
    theta.add_(direction, alpha=-cfg.lr)


def weighted_average(contributions: list[tuple[float, torch.Tensor]]) -> torch.Tensor:
    """``sum_i w_i x_i / sum_i w_i`` in the given order (the order every DC agrees on), float32.

    All weights 0 (no DC trained on any token) averages uniformly instead.
    """
    assert contributions, "nothing to average"
    total = sum(w for w, _ in contributions)
    if total <= 0:
        contributions = [(1.0, x) for _, x in contributions]
        total = float(len(contributions))
    out = torch.zeros_like(contributions[0][1], dtype=torch.float32)
    for weight, x in contributions:
        out.add_(x, alpha=weight / total)
    return out

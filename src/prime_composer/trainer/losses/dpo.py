"""The replay term: DPO on the teacher service's step-level pairs, against stored reference logprobs.

Per pair p with policy sequence logprobs (sums over the side's tokens) ``c_p`` (chosen), ``r_p``
(rejected) and the reference's ``c_p^ref``, ``r_p^ref``, the log-ratio margin is

    h_p = (c_p - c_p^ref) - (r_p - r_p^ref)

and, with label smoothing eps_p (the chance the preference is flipped; per pair from the teachers'
vote share, or one value from the config):

    sigmoid:  l_p = -(1 - eps_p) log sigma(beta h_p) - eps_p log sigma(-beta h_p)     (DPO; cDPO if eps > 0)
    robust:   l_p = [-(1 - eps_p) log sigma(beta h_p) + eps_p log sigma(-beta h_p)] / (1 - 2 eps_p)   (rDPO)
    ipo:      l_p = (h'_p - 1 / (2 beta))^2,   h'_p = (c_p - c_p^ref) / n^c_p - (r_p - r_p^ref) / n^r_p

where ``n^c_p``, ``n^r_p`` are the sides' token counts: IPO on per-token averaged log-ratios, the
normalization TRL uses (its authors confirmed the paper's results use it). The micro-batch
returns ``sum_p l_p / normalizer`` with ``normalizer`` the step's *global* pair count (all
micro-batches, all ranks: ``pair_normalizer``), so the per-micro-batch losses add up to the step's
mean over pairs however the pairs are split, like the RL and SDPO terms. The weight
(``loss.replay.weight``, beta_replay of the objective) is applied by the step, not here.

How it departs from TRL's ``DPOTrainer``: TRL averages per batch (``mean``) and takes one
label-smoothing value; here the denominator is global and eps may differ per pair. TRL 1.16's
``sigmoid`` ignores label smoothing; here eps > 0 gives the conservative (cDPO) mixture, which
equals ``(1 - eps) * TRL(chosen, rejected) + eps * TRL(rejected, chosen)``.
``tests/unit/test_loss_dpo.py`` checks values and gradients against TRL's own loss code.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from prime_composer.config.dpo import DPOLossConfig
from prime_composer.trainer.losses.aggregate import metric_pair


def pair_normalizer(num_pairs: int, group: dist.ProcessGroup | None = None) -> float:
    """The step's global pair count: ``num_pairs`` of this rank's micro-batches, summed over the
    ranks of ``group`` when ``torch.distributed`` is initialized (every rank must call it)."""
    total = torch.tensor(float(num_pairs))
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return float(total.item())


def _check(name: str, tensor: Tensor | None, size: int) -> None:
    if tensor is not None and tuple(tensor.shape) != (size,):
        raise ValueError(
            f"dpo_loss: {name} must have shape [{size}] (one value per pair), got {tuple(tensor.shape)}"
        )


def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    cfg: DPOLossConfig,
    normalizer: float | Tensor,
    *,
    num_chosen_tokens: Tensor | None = None,
    num_rejected_tokens: Tensor | None = None,
    label_smoothing: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """One micro-batch's share of the step's DPO loss.

    Args:
        chosen_logps: [P] the policy's log-probability of each pair's chosen side: the sum over its
            tokens (at temperature 1); carries the gradient.
        rejected_logps: [P] the same for the rejected side.
        ref_chosen_logps: [P] the reference model's sums for the chosen sides (stored with the
            pairs); treated as constants.
        ref_rejected_logps: [P] the same for the rejected sides.
        cfg: the ``loss.replay`` section (``loss_type``, ``beta``, ``label_smoothing``).
        normalizer: the step's global pair count (``pair_normalizer``); 0 gives a loss of 0.
        num_chosen_tokens: [P] tokens of each chosen side; required for ``ipo``.
        num_rejected_tokens: [P] tokens of each rejected side; required for ``ipo``.
        label_smoothing: [P] per-pair flip probabilities in [0, 0.5) (the pairs' vote-derived
            smoothing), one float for all, or None for ``cfg.label_smoothing``. Not used by ``ipo``.

    Returns:
        ``(loss, metrics)``: ``loss`` = ``sum_p l_p / normalizer`` (a scalar). ``metrics`` are
        ``[sum, count]`` pairs over this micro-batch's pairs: ``dpo/loss`` (per pair),
        ``dpo/margin`` (``beta * h``), ``dpo/chosen_reward`` and ``dpo/rejected_reward`` (``beta``
        times each side's log-ratio), ``dpo/accuracy`` (fraction with ``h > 0``),
        ``dpo/label_smoothing``.
    """
    if chosen_logps.dim() != 1:
        raise ValueError(f"dpo_loss: chosen_logps must be [P], got {tuple(chosen_logps.shape)}")
    num_pairs = chosen_logps.shape[0]
    for name, tensor in (
        ("rejected_logps", rejected_logps),
        ("ref_chosen_logps", ref_chosen_logps),
        ("ref_rejected_logps", ref_rejected_logps),
        ("num_chosen_tokens", num_chosen_tokens),
        ("num_rejected_tokens", num_rejected_tokens),
    ):
        _check(name, tensor, num_pairs)
    dtype = torch.promote_types(chosen_logps.dtype, torch.float32)
    device = chosen_logps.device
    chosen_ratio = chosen_logps.to(dtype) - ref_chosen_logps.detach().to(dtype)
    rejected_ratio = rejected_logps.to(dtype) - ref_rejected_logps.detach().to(dtype)
    margin = chosen_ratio - rejected_ratio

    if cfg.loss_type == "ipo":
        label_smoothing = 0.0  # IPO has no flip model
    eps = torch.as_tensor(
        cfg.label_smoothing if label_smoothing is None else label_smoothing, dtype=dtype, device=device
    )
    eps = eps.detach().expand(num_pairs) if eps.dim() == 0 else eps.detach()
    _check("label_smoothing", eps, num_pairs)
    if num_pairs and (eps.min() < 0 or eps.max() >= 0.5):
        raise ValueError(
            f"dpo_loss: label smoothing must lie in [0, 0.5), got values in [{eps.min().item()}, {eps.max().item()}]"
        )

    beta = cfg.beta
    if cfg.loss_type == "sigmoid":
        per_pair = -(1 - eps) * F.logsigmoid(beta * margin) - eps * F.logsigmoid(-beta * margin)
    elif cfg.loss_type == "robust":
        per_pair = (-(1 - eps) * F.logsigmoid(beta * margin) + eps * F.logsigmoid(-beta * margin)) / (
            1 - 2 * eps
        )
    else:  # ipo
        if num_chosen_tokens is None or num_rejected_tokens is None:
            raise ValueError("dpo_loss: loss_type = 'ipo' needs num_chosen_tokens and num_rejected_tokens")
        averaged = chosen_ratio / num_chosen_tokens.to(dtype).clamp(
            min=1.0
        ) - rejected_ratio / num_rejected_tokens.to(dtype).clamp(min=1.0)
        per_pair = (averaged - 1.0 / (2.0 * beta)) ** 2

    denominator = torch.as_tensor(normalizer, dtype=dtype, device=device)
    loss = per_pair.sum() / torch.where(denominator > 0, denominator, 1.0)

    with torch.no_grad():
        metrics = {
            "dpo/loss": metric_pair(per_pair.sum(), num_pairs),
            "dpo/margin": metric_pair((beta * margin).sum(), num_pairs),
            "dpo/chosen_reward": metric_pair((beta * chosen_ratio).sum(), num_pairs),
            "dpo/rejected_reward": metric_pair((beta * rejected_ratio).sum(), num_pairs),
            "dpo/accuracy": metric_pair((margin > 0).sum(), num_pairs),
            "dpo/label_smoothing": metric_pair(eps.sum(), num_pairs),
        }
    return loss, metrics

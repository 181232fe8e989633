"""The SDPO teacher: the policy's weights (live), an EMA of them, or the initial ones (frozen).

The teacher reads the hinted context and scores the same target tokens as the student; it never
receives gradients. Its weights, by ``loss.sdpo.teacher``:

- ``live``: the policy module itself, run under ``torch.no_grad()`` (no extra memory; reported to
  diverge, since the target moves with every step);
- ``ema``: a copy updated after every optimizer step, ``p_t = rate * p_t + (1 - rate) * p_s``
  (the SDPO reference default);
- ``frozen``: a copy of the policy at construction, never updated.

Copies are sharded like the policy: on one process a ``deepcopy``; under FSDP2 the caller passes
``make_copy`` (e.g. load and ``fully_shard`` the model again) and the policy's local shards are
copied in. The EMA update then works on each rank's local shards only, no gather: both modules
have the same parameters in the same order with the same sharding.

Teacher logits are taken only where needed: ``logits`` asks the model for the positions that
predict target tokens (``logits_to_keep``, when the model accepts it) instead of a full
``[R, T, V]`` tensor. It runs under ``no_grad`` rather than ``inference_mode``: the result is used
next to the student's graph in the loss, which inference tensors may not be.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable

import torch
from torch import Tensor, nn

from prime_composer.config.loss import SDPOLossConfig


def _local(tensor: Tensor) -> Tensor:
    """The rank-local shard of a DTensor (FSDP2 parameter), the tensor itself otherwise."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


class TeacherModel:
    """Holds the teacher weights for ``cfg.teacher`` and runs the no-grad teacher forward."""

    def __init__(
        self,
        policy: nn.Module,
        cfg: SDPOLossConfig,
        make_copy: Callable[[], nn.Module] | None = None,
    ) -> None:
        """``make_copy`` builds an empty module sharded like ``policy`` (needed under FSDP2, where a
        deepcopy of a sharded module is not supported); None deep-copies ``policy``."""
        self.kind = cfg.teacher
        self.rate = cfg.ema_rate
        self.num_forwards = 0
        """Teacher forwards run so far (tests check that ``weight = 0`` runs none)."""
        if self.kind == "live":
            self.module = policy
            return
        if make_copy is None:
            self.module = copy.deepcopy(policy)
        else:
            self.module = make_copy()
            self._copy_from(policy)
        self.module.requires_grad_(False)
        self.module.eval()

    def _pairs(self, policy: nn.Module) -> list[tuple[Tensor, Tensor]]:
        """(teacher, policy) local tensors of every parameter and floating buffer, matched by name."""
        mine = dict(self.module.named_parameters()) | {
            k: b for k, b in self.module.named_buffers() if b.is_floating_point()
        }
        theirs = dict(policy.named_parameters()) | {
            k: b for k, b in policy.named_buffers() if b.is_floating_point()
        }
        if mine.keys() != theirs.keys():
            missing = sorted(mine.keys() ^ theirs.keys())[:5]
            raise ValueError(f"SDPO teacher and policy have different parameters (e.g. {missing})")
        pairs = []
        for name, t in mine.items():
            t_local, p_local = _local(t.detach()), _local(theirs[name].detach())
            if t_local.shape != p_local.shape:
                raise ValueError(
                    f"SDPO teacher parameter {name} has local shape {tuple(t_local.shape)} but the policy's is "
                    f"{tuple(p_local.shape)}: the teacher copy must be sharded like the policy"
                )
            pairs.append((t_local, p_local))
        return pairs

    @torch.no_grad()
    def _copy_from(self, policy: nn.Module) -> None:
        for t, p in self._pairs(policy):
            t.copy_(p)

    @torch.no_grad()
    def update(self, policy: nn.Module) -> None:
        """After an optimizer step: the EMA moves toward the policy; live and frozen do nothing."""
        if self.kind != "ema":
            return
        for t, p in self._pairs(policy):
            # p_t <- rate * p_t + (1 - rate) * p_s, computed in float32 then stored in p_t's dtype.
            t.copy_(torch.lerp(t.float(), p.float(), 1.0 - self.rate).to(t.dtype))

    @torch.no_grad()
    def logits(
        self, input_ids: Tensor, position_ids: Tensor, target_mask: Tensor, temperature: float
    ) -> Tensor:
        """Teacher logits ``[N, V]`` (float32, divided by ``temperature``) for the N target tokens.

        Args:
            input_ids, position_ids: ``[R, T]`` packed teacher rows (positions restart at 0 for every
                packed sequence, like the student's).
            target_mask: ``[R, T]`` bool, True on target tokens; row ``n`` of the result is the
                distribution target token ``n`` (row-major order) was predicted from, i.e. the logits
                at the position before it. A target is never the first token of a sequence.
        """
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 to score tokens, got {temperature}")
        self.num_forwards += 1
        device = next(self.module.parameters()).device
        input_ids, position_ids, target_mask = (
            input_ids.to(device),
            position_ids.to(device),
            target_mask.to(device),
        )
        predicting = torch.zeros_like(target_mask)
        predicting[:, :-1] = target_mask[:, 1:]  # the position before each target predicts it
        rows, cols = predicting.nonzero(as_tuple=True)  # row-major, like the student's mask
        kwargs = {}
        keep = torch.unique(cols)
        if _accepts_logits_to_keep(self.module):
            kwargs["logits_to_keep"] = keep
        else:
            keep = torch.arange(input_ids.shape[1], device=device)
        logits = self.module(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs).logits
        slot = torch.full((input_ids.shape[1],), -1, dtype=torch.long, device=device)
        slot[keep] = torch.arange(keep.numel(), device=device)
        picked = logits[rows, slot[cols]].float()
        return picked / temperature if temperature != 1.0 else picked


def _accepts_logits_to_keep(module: nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(module.forward).parameters

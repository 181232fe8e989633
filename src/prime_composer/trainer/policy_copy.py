"""Copies of the policy that loss terms score tokens with: live, an EMA of it, or the initial weights.

A copy never receives gradients. The SDPO term's teacher reads the hinted context and scores the
same target tokens as the student; the RL term's KL reference scores the sampled tokens. Kinds
(``loss.sdpo.teacher``; the KL reference is always ``frozen``):

- ``live``: the policy module itself, run under ``torch.no_grad()`` (no extra memory; reported to
  diverge, since the target moves with every step);
- ``ema``: a copy updated after every optimizer step, ``p_t = rate * p_t + (1 - rate) * p_s``
  (the SDPO reference default);
- ``frozen``: a copy of the policy at construction, never updated.

Terms get copies from ``trainer/losses/base.py``'s ``TermContext``, which makes at most one copy
per kind (the SDPO teacher and the KL reference share one ``frozen`` copy), updates the EMA after
each optimizer step and checkpoints the copies.

Copies are sharded like the policy: on one process a ``deepcopy``; under FSDP2 the caller passes
``make_copy`` (e.g. load and ``fully_shard`` the model again) and the policy's local shards are
copied in. The EMA update then works on each rank's local shards only, no gather: both modules
have the same parameters in the same order with the same sharding.

EMA precision: when the copy's parameters are bf16/fp16, the average itself is kept in an fp32
master copy and the module's weights are refreshed from it after every update. In bf16 (8-bit
mantissa) ``(1 - rate) * (p_s - p_t)`` is usually below half a unit in the last place of ``p_t`` at
``rate = 0.99``, so a bf16 average would round every step away and stall. Cost: 4 bytes per
(local) parameter on top of the copy; under FSDP mixed precision the parameters are already fp32
and there is no master.

Checkpoints: ``state_dict`` / ``load_state_dict`` (torch.distributed.checkpoint's ``Stateful``)
hold the kind and, for ``ema`` and ``frozen``, the weights (the fp32 master where there is one,
DTensor shards under FSDP), so a resumed run continues with the same copy: the EMA where it
was, the frozen copy still the run's *initial* policy (not the resumed one).

Target logits (``target_logits``) are taken only where needed: a forward pre-hook on the model's output head
(``get_output_embeddings()``) hands it only the hidden states of the N positions that predict
target tokens, so the head produces ``[N, V]`` instead of ``[R, T, V]``; whatever the model does
after the head (soft-capping, scaling) still applies. A module without an output head gets the
full logits, then the rows are picked. It runs under ``no_grad`` rather than ``inference_mode``:
the result is used next to the student's graph in the loss, which inference tensors may not be.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor, nn

from prime_composer.trainer.forward import forward_micro_batch
from prime_composer.transport.batch import MicroBatch

CopyKind = Literal["live", "ema", "frozen"]


def _local(tensor: Tensor) -> Tensor:
    """The rank-local shard of a DTensor (FSDP2 parameter), the tensor itself otherwise."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


class PolicyCopy:
    """Holds the weights of one ``kind`` of policy copy and runs its no-grad forwards."""

    def __init__(
        self,
        policy: nn.Module,
        kind: CopyKind,
        *,
        ema_rate: float = 0.99,
        make_copy: Callable[[], nn.Module] | None = None,
    ) -> None:
        """``ema_rate`` is the EMA decay per optimizer step (``ema`` only); ``make_copy`` builds an
        empty module sharded like ``policy`` (needed under FSDP2, where a deepcopy of a sharded module
        is not supported); None deep-copies ``policy``."""
        if kind not in ("live", "ema", "frozen"):
            raise ValueError(f"policy copy kind must be 'live', 'ema' or 'frozen', got {kind!r}")
        self.kind: CopyKind = kind
        self.rate = ema_rate
        self.num_forwards = 0
        """Forwards run so far (tests check that a term with weight 0 runs none)."""
        self.master: dict[str, Tensor] = {}
        """fp32 EMA of the parameters and floating buffers stored in bf16/fp16 (DTensors under
        FSDP, like the module's), by name; empty when the module is fp32 or the kind is not ema."""
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
        if self.kind == "ema":
            self.master = {
                name: tensor.detach().to(torch.float32, copy=True)
                for name, tensor in self._tensors(self.module).items()
                if torch.finfo(tensor.dtype).bits < 32
            }

    @staticmethod
    def _tensors(module: nn.Module) -> dict[str, Tensor]:
        """Every parameter and floating buffer of ``module`` by name (what the copy holds)."""
        return dict(module.named_parameters()) | {
            k: b for k, b in module.named_buffers() if b.is_floating_point()
        }

    def _pairs(self, policy: nn.Module) -> list[tuple[str, Tensor, Tensor]]:
        """(name, copy, policy) local tensors of every parameter and floating buffer."""
        mine, theirs = self._tensors(self.module), self._tensors(policy)
        if mine.keys() != theirs.keys():
            missing = sorted(mine.keys() ^ theirs.keys())[:5]
            raise ValueError(f"policy copy and policy have different parameters (e.g. {missing})")
        pairs = []
        for name, t in mine.items():
            t_local, p_local = _local(t.detach()), _local(theirs[name].detach())
            if t_local.shape != p_local.shape:
                raise ValueError(
                    f"policy copy parameter {name} has local shape {tuple(t_local.shape)} but the policy's is "
                    f"{tuple(p_local.shape)}: the copy must be sharded like the policy"
                )
            pairs.append((name, t_local, p_local))
        return pairs

    @torch.no_grad()
    def _copy_from(self, policy: nn.Module) -> None:
        for _, t, p in self._pairs(policy):
            t.copy_(p)

    @torch.no_grad()
    def update(self, policy: nn.Module) -> None:
        """After an optimizer step: the EMA moves toward the policy; live and frozen do nothing."""
        if self.kind != "ema":
            return
        for name, t, p in self._pairs(policy):
            master = self.master.get(name)
            average = _local(master) if master is not None else t
            # p_t <- rate * p_t + (1 - rate) * p_s, in the average's precision (fp32 at least).
            average.lerp_(p.to(average.dtype), 1.0 - self.rate)
            if master is not None:
                t.copy_(average)

    def state_dict(self) -> dict[str, Any]:
        """For checkpoints: ``{"kind", "weights"}``; the weights (``ema``: the fp32 master where there
        is one) are the live tensors, so ``torch.distributed.checkpoint.load`` fills them in place.
        ``live`` has no weights of its own."""
        if self.kind == "live":
            return {"kind": self.kind}
        weights = {
            name: self.master.get(name, tensor).detach()
            for name, tensor in self._tensors(self.module).items()
        }
        return {"kind": self.kind, "weights": weights}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (after ``torch.distributed.checkpoint.load`` filled it,
        or a plain dict of the same layout)."""
        if state.get("kind") != self.kind:
            raise ValueError(
                f"the checkpoint's policy copy is {state.get('kind')!r} but this run needs {self.kind!r} "
                "(loss.sdpo.teacher): resume with the settings the run was saved with"
            )
        if self.kind == "live":
            return
        mine = self.state_dict()["weights"]
        if state["weights"].keys() != mine.keys():
            missing = sorted(state["weights"].keys() ^ mine.keys())[:5]
            raise ValueError(f"the checkpoint's policy copy has different parameters (e.g. {missing})")
        for name, tensor in mine.items():
            if state["weights"][name] is not tensor:
                tensor.copy_(state["weights"][name])
        # The module's low-precision weights follow their fp32 master.
        tensors = self._tensors(self.module)
        for name, master in self.master.items():
            _local(tensors[name].detach()).copy_(_local(master))

    @torch.no_grad()
    def token_logprobs(self, mb: MicroBatch) -> Tensor:
        """``[R, T]`` float32 log-probabilities of ``mb``'s core tokens at ``mb.temperature`` under
        this copy (aligned like ``ForwardOutput.logprobs``), e.g. for the KL reference."""
        self.num_forwards += 1
        return forward_micro_batch(self.module, mb, entropy=False).logprobs

    @torch.no_grad()
    def target_logits(
        self, input_ids: Tensor, position_ids: Tensor, target_mask: Tensor, temperature: float
    ) -> Tensor:
        """Logits ``[N, V]`` (float32, divided by ``temperature``) for the N target tokens.

        Args:
            input_ids, position_ids: ``[R, T]`` packed rows (positions restart at 0 for every
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
        head = _output_head(self.module)
        if head is None:
            logits = self.module(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
            picked = logits[rows, cols]
        else:

            def only_targets(_: nn.Module, args: tuple[Any, ...]) -> tuple[Tensor]:
                hidden = args[0] if len(args) == 1 else None
                if hidden is None or tuple(hidden.shape[:2]) != tuple(input_ids.shape):
                    raise RuntimeError(
                        f"policy copy: expected the output head of {type(self.module).__name__} to get "
                        f"one [R, T, H] hidden-state tensor for [R, T] = {tuple(input_ids.shape)}, got "
                        f"{[tuple(a.shape) for a in args if isinstance(a, Tensor)]}"
                    )
                return (hidden[rows, cols][None],)

            handle = head.register_forward_pre_hook(only_targets)
            try:
                logits = self.module(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
            finally:
                handle.remove()
            picked = logits[0]
        picked = picked.float()
        return picked / temperature if temperature != 1.0 else picked


def _output_head(module: nn.Module) -> nn.Module | None:
    """The module mapping hidden states to logits (a Hugging Face model's ``lm_head``), if known."""
    get = getattr(module, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, nn.Module) else None

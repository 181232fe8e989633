"""Checking and applying weight updates to the live model, and returning to the base weights.

Only the decode loop's thread calls ``apply``, between two forwards, so a forward never sees half
of an update. ``check`` runs before (on the request's side), so a bad file is refused without
touching the model. Tied parameters (e.g. input and output embeddings) are one tensor here: a file
needs either of their names, as ``save_pretrained`` writes only one.

A LoRA update (``transport/adapter.py``) becomes a full state dict before it is applied:
``with_adapter`` merges the adapter onto the *first* weights kept here, so the swap itself is the
same copy as for whole weights, and each adapter replaces the one before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import torch

from prime_composer.transport.adapter import Adapter, merged_weights

logger = logging.getLogger(__name__)


class WeightSwapper:
    """Copies state dicts into a model's parameters in place; keeps a CPU copy of the first weights."""

    def __init__(self, model: Any) -> None:
        self._params: dict[str, torch.Tensor] = model.state_dict(keep_vars=True)
        self._groups = _alias_groups(self._params)
        self._base: dict[str, torch.Tensor] | None = None

    def check(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Raise ``ValueError`` unless ``state_dict`` covers exactly this model's weights."""
        unknown = sorted(k for k in state_dict if k not in self._params)
        missing = [group[0] for group in self._groups if not any(n in state_dict for n in group)]
        wrong_shape = [
            f"{k}: {tuple(t.shape)} != {tuple(self._params[k].shape)}"
            for k, t in state_dict.items()
            if k in self._params and tuple(t.shape) != tuple(self._params[k].shape)
        ]
        problems = []
        if unknown:
            problems.append(f"{len(unknown)} unexpected keys (e.g. {unknown[:3]})")
        if missing:
            problems.append(f"{len(missing)} missing keys (e.g. {missing[:3]})")
        if wrong_shape:
            problems.append(f"{len(wrong_shape)} shape mismatches (e.g. {wrong_shape[:2]})")
        if problems:
            raise ValueError("the weights do not match the served model: " + "; ".join(problems))

    def base_weights(self) -> dict[str, torch.Tensor]:
        """The first weights (CPU copies, one name per tied group), taken now if no update has
        happened yet. Read-only: a LoRA update is merged onto these, never onto the live weights."""
        if self._base is None:
            # Taken lazily, so a server that never updates pays no memory for it. Only the update
            # path calls this, one update at a time, while the weights are still the first ones.
            with torch.no_grad():
                self._base = {g[0]: self._params[g[0]].detach().to("cpu", copy=True) for g in self._groups}
        return self._base

    def with_adapter(self, adapter: Adapter) -> dict[str, torch.Tensor]:
        """The full state dict that serves ``adapter``: the base weights with each adapted layer
        replaced by ``W0 + scale * B @ A`` (so a new adapter replaces the previous one, never adds
        to it). ``ValueError`` when the adapter does not fit this model."""
        base = self.base_weights()
        return {**base, **merged_weights(base, adapter)}

    def apply(self, state_dict: Mapping[str, torch.Tensor] | None) -> None:
        """Copy ``state_dict`` (checked) into the model; ``None`` restores the first weights."""
        began = time.perf_counter()
        with torch.no_grad():
            self.base_weights()
            source = state_dict if state_dict is not None else self._base
            for name, tensor in source.items():
                self._params[name].copy_(tensor)
        what = "updated" if state_dict is not None else "reset to the base weights"
        logger.info("weights %s in %.2f s", what, time.perf_counter() - began)


def _alias_groups(params: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """State-dict names grouped by the storage they share (tied embeddings form one group)."""
    groups: dict[tuple[int, int], list[str]] = {}
    for name, tensor in params.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        groups.setdefault(key, []).append(name)
    return list(groups.values())

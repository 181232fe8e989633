"""Splitting a model into fragments and moving a fragment between the model and flat vectors.

A fragment is a run of consecutive parameters (in ``named_parameters`` order: embeddings, then
decoder layers in depth order, then the head) of about ``total / P`` elements, so each sync moves
about the same number of bytes and, as in Streaming DiLoCo, a fragment is a block of layers.
The outer state of a fragment (its global weights and outer momentum) is one flat float32 CPU
vector each, laid out in that parameter order.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Fragment:
    """One fragment: the parameters it owns, in order, and their names and shapes."""

    index: int
    names: tuple[str, ...]
    params: tuple[nn.Parameter, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def layout_digest(self) -> str:
        """SHA-256 of the names and shapes: two DCs exchange a fragment only if theirs agree."""
        layout = [[n, list(p.shape)] for n, p in zip(self.names, self.params, strict=True)]
        return hashlib.sha256(json.dumps(layout).encode()).hexdigest()

    def read(self) -> torch.Tensor:
        """The fragment's current local weights as one flat float32 CPU vector (a copy)."""
        return torch.cat([_local(p).detach().reshape(-1).to("cpu", torch.float32) for p in self.params])

    @torch.no_grad()
    def write(self, flat: torch.Tensor) -> None:
        """Copy a flat vector into the fragment's parameters (cast to their dtype and device)."""
        offset = 0
        for p in self.params:
            local = _local(p)
            n = local.numel()
            local.copy_(flat[offset : offset + n].view_as(local))
            offset += n
        assert offset == flat.numel()

    @torch.no_grad()
    def merge(self, global_flat: torch.Tensor, alpha: float) -> None:
        """``local = alpha * local + (1 - alpha) * global`` (alpha 0 takes the global weights)."""
        if alpha == 0.0:
            self.write(global_flat)
            return
        offset = 0
        for p in self.params:
            local = _local(p)
            n = local.numel()
            target = global_flat[offset : offset + n].view_as(local).to(local.device, local.dtype)
            local.lerp_(target, 1.0 - alpha)
            offset += n


def split_fragments(model: nn.Module, num_fragments: int) -> list[Fragment]:
    """``num_fragments`` runs of consecutive parameters with about equal element counts.

    Raises ``ValueError`` when the model has fewer parameter tensors than fragments.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if len(named) < num_fragments:
        raise ValueError(
            f"diloco.num_fragments = {num_fragments} but the model has only {len(named)} trainable "
            "parameter tensors: lower diloco.num_fragments"
        )
    total = sum(p.numel() for _, p in named)
    groups: list[list[tuple[str, nn.Parameter]]] = [[]]
    seen = 0
    for i, (name, param) in enumerate(named):
        still_to_open = num_fragments - len(groups)
        # Open the next fragment when this tensor's midpoint lies past the current one's share,
        # or when every remaining tensor is needed to give each later fragment one.
        past_share = seen + param.numel() / 2 > len(groups) * total / num_fragments
        if groups[-1] and still_to_open > 0 and (past_share or len(named) - i == still_to_open):
            groups.append([])
        groups[-1].append((name, param))
        seen += param.numel()
    assert len(groups) == num_fragments and all(groups)
    return [Fragment(i, tuple(n for n, _ in g), tuple(p for _, p in g)) for i, g in enumerate(groups)]


def _local(p: torch.Tensor) -> torch.Tensor:
    """The tensor holding this process's values (a DTensor's local shard, else itself)."""
    to_local = getattr(p, "to_local", None)
    return to_local() if callable(to_local) else p.data

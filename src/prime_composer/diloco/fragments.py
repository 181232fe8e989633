"""Splitting a model into fragments and moving a fragment between the model and flat vectors.

A fragment is a run of consecutive parameters (in ``named_parameters`` order: embeddings, then
decoder layers in depth order, then the head) of about ``total / P`` elements, so each sync moves
about the same number of bytes and, as in Streaming DiLoCo, a fragment is a block of layers.
The outer state of a fragment (its global weights and outer momentum) is one flat float32 CPU
vector each, laid out in that parameter order.

Under FSDP2 a parameter is a ``DTensor`` whose shards live on the DC's ranks. The names and
shapes are then the full (global) ones, so a DC of any number of ranks splits the model into the
same fragments. ``gather`` and ``scatter``/``merge`` are collectives there: ``gather`` all-gathers
one parameter at a time (``full_tensor``) and keeps the flat fragment on rank 0 only, and
``scatter`` sends rank 0's flat vector out parameter by parameter (``distribute_tensor`` from rank
0), each rank keeping its own shard. So the transient cost per rank is one full parameter, and
rank 0 holds the fragment as one float32 vector (4 bytes a parameter), the same as a DC of one rank.
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
        """The fragment's current local weights as one flat float32 CPU vector (a copy); whole
        tensors only (``gather`` for a sharded model)."""
        assert not self.sharded, "a sharded fragment is read with gather()"
        return torch.cat([_local(p).detach().reshape(-1).to("cpu", torch.float32) for p in self.params])

    @property
    def sharded(self) -> bool:
        """Whether the parameters are FSDP2 shards (``DTensor``s): then the methods below are
        collectives every rank of the DC calls together."""
        return any(_is_dtensor(p) for p in self.params)

    @torch.no_grad()
    def gather(self, leader: bool) -> torch.Tensor | None:
        """The full fragment as one flat float32 CPU vector on the ``leader`` rank, None on the
        others (collective for sharded parameters: one all-gather per parameter)."""
        if not self.sharded:
            return self.read() if leader else None
        parts: list[torch.Tensor] = []
        for p in self.params:
            full = p.detach().full_tensor() if _is_dtensor(p) else p.detach()  # type: ignore[attr-defined]
            if leader:
                parts.append(full.reshape(-1).to("cpu", torch.float32))
            del full
        return torch.cat(parts) if leader else None

    @torch.no_grad()
    def scatter(self, flat: torch.Tensor | None, alpha: float = 0.0) -> None:
        """Set the fragment from the leader's flat vector (``flat``; None on the other ranks):
        ``local = alpha * local + (1 - alpha) * flat`` on every rank's shard (collective for
        sharded parameters: one scatter from rank 0 per parameter)."""
        if not self.sharded:
            assert flat is not None
            self.merge(flat, alpha)
            return
        from torch.distributed.tensor import distribute_tensor

        offset = 0
        for p in self.params:
            n = p.numel()
            if flat is not None:
                full = flat[offset : offset + n].view(p.shape)
            else:  # the values of the non-source ranks are not read
                full = torch.empty(p.shape, dtype=torch.float32)
            offset += n
            if _is_dtensor(p):
                mesh, placements = p.device_mesh, p.placements  # type: ignore[attr-defined]
                full = full.to(mesh.device_type)
                target = distribute_tensor(full, mesh, placements, src_data_rank=0).to_local()
            else:  # a whole tensor beside the shards: every rank takes rank 0's
                torch.distributed.broadcast(full, src=0)
                target = full
            local = _local(p)
            target = target.to(local.device, local.dtype)
            if alpha == 0.0:
                local.copy_(target)
            else:
                local.lerp_(target, 1.0 - alpha)

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


def _is_dtensor(p: torch.Tensor) -> bool:
    return callable(getattr(p, "full_tensor", None))


def _local(p: torch.Tensor) -> torch.Tensor:
    """The tensor holding this process's values (a DTensor's local shard, else itself)."""
    to_local = getattr(p, "to_local", None)
    return to_local() if callable(to_local) else p.data

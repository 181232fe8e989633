"""The batch KV cache of the decode loop: one row per running sequence, left-padded, grown in place.

Layout: every layer holds keys and values of shape ``[num_rows, num_kv_heads, capacity, head_dim]``.
All rows share the column of the token being decoded (column ``length``), so a decode step is one
batched forward with ``q_len = 1``. A row whose sequence is shorter than the batch is left-padded:
its tokens sit in columns ``[start, length)`` and the attention mask hides ``[0, start)``. Padded
columns hold zeros or the keys/values of pad tokens, always finite, so masked scores stay finite and
get exactly zero weight after softmax.

Why not transformers' ``DynamicCache``: it concatenates on every step (a copy of the whole cache
per token) and cannot merge sequences of different lengths. Here a step writes one column in place
and the buffers only move when sequences join or leave (``gather``), or when capacity doubles.
The class still is a transformers ``Cache`` so the model's attention layers call ``update`` on it
as usual.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

_HEADROOM = 64  # spare columns allocated on every (re)build, so most steps never reallocate


class _GrowingLayer(DynamicLayer):
    """One layer's keys/values with spare capacity; ``keys``/``values`` are views of the filled part."""

    def __init__(self) -> None:
        super().__init__()
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def set_buffers(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        self._k, self._v, self.length = keys, values, length
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._refresh_views()

    def _refresh_views(self) -> None:
        assert self._k is not None and self._v is not None
        self.keys = self._k[:, :, : self.length]
        self.values = self._v[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        num_new = key_states.shape[-2]
        if self._k is None:
            capacity = num_new + _HEADROOM
            self.set_buffers(_zeros(key_states, capacity), _zeros(value_states, capacity), 0)
        assert self._k is not None and self._v is not None
        end = self.length + num_new
        if end > self._k.shape[2]:
            self._grow(max(end, 2 * self._k.shape[2]))
        self._k[:, :, self.length : end] = key_states
        self._v[:, :, self.length : end] = value_states
        self.length = end
        self._refresh_views()
        return self.keys, self.values

    def _grow(self, capacity: int) -> None:
        assert self._k is not None and self._v is not None
        k, v = _zeros(self._k, capacity), _zeros(self._v, capacity)
        k[:, :, : self.length] = self._k[:, :, : self.length]
        v[:, :, : self.length] = self._v[:, :, : self.length]
        self._k, self._v = k, v

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0


def _zeros(like: torch.Tensor, capacity: int, num_rows: int | None = None) -> torch.Tensor:
    """Zeros shaped like ``like`` ``[rows, heads, cols, dim]`` with ``capacity`` columns."""
    rows = like.shape[0] if num_rows is None else num_rows
    return like.new_zeros((rows, like.shape[1], capacity, like.shape[3]))


class BatchKVCache(Cache):
    """A transformers ``Cache`` over ``_GrowingLayer``s; every layer has the same ``length``."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[_GrowingLayer() for _ in range(num_layers)])

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    @property
    def num_rows(self) -> int:
        first = self.layers[0]
        return 0 if first.keys is None else first.keys.shape[0]

    def shift_prefix(self, shifts: list[int], num_prefix: int) -> None:
        """Move the first ``num_prefix`` columns of row ``r`` right by ``shifts[r]``, in place.

        For a prefill that ran a shared prompt prefix once: row ``r`` holds the prefix in columns
        ``[0, num_prefix)``, its left padding after it, then its own tokens. After the move the
        prefix sits right before the row's own tokens, so the row's tokens are again one run of
        columns ``[shifts[r], length)``. Columns left of it keep finite leftovers (masked).
        """
        column = torch.arange(self.length)
        shift = torch.tensor(shifts).unsqueeze(1)
        in_prefix = (column >= shift) & (column < shift + num_prefix)
        source = torch.where(in_prefix, column - shift, column)  # [rows, length]: column to read
        for layer in self.layers:
            assert layer._k is not None and layer._v is not None
            index = source.to(layer._k.device)[:, None, :, None].expand_as(layer.keys)
            layer._k[:, :, : self.length] = layer.keys.gather(2, index)
            layer._v[:, :, : self.length] = layer.values.gather(2, index)


@dataclass
class RowSource:
    """Rows to take from one cache into a rebuilt one: ``rows[i]`` of ``cache``, columns from ``first_column``."""

    cache: BatchKVCache
    rows: list[int]
    first_column: int


def gather(sources: list[RowSource]) -> tuple[BatchKVCache, list[int]]:
    """Build one cache from rows of several, right-aligned; returns it and each source's column shift.

    Each source contributes columns ``[first_column, length)`` of the listed rows (a row may be
    listed more than once, e.g. ``n`` choices sharing one prefilled prompt). The new cache is as
    wide as the widest contribution; narrower ones are left-padded with zeros. A row whose valid
    tokens started at column ``s`` in its source starts at ``s + shift`` in the result.
    """
    if not any(s.rows for s in sources):
        raise ValueError("gather needs at least one row")
    widths = [s.cache.length - s.first_column for s in sources]
    length = max(w for s, w in zip(sources, widths, strict=True) if s.rows)
    num_rows = sum(len(s.rows) for s in sources)
    first = next(s for s in sources if s.rows).cache
    result = BatchKVCache(len(first.layers))
    for layer_idx, ref in enumerate(first.layers):
        assert ref._k is not None and ref._v is not None
        keys = _zeros(ref._k, length + _HEADROOM, num_rows)
        values = _zeros(ref._v, length + _HEADROOM, num_rows)
        row = 0
        for source, width in zip(sources, widths, strict=True):
            if not source.rows:
                continue
            layer = source.cache.layers[layer_idx]
            index = torch.tensor(source.rows, device=ref._k.device)
            cols = slice(source.first_column, source.cache.length)
            dest = slice(row, row + len(source.rows))
            keys[dest, :, length - width : length] = layer._k[index, :, cols]
            values[dest, :, length - width : length] = layer._v[index, :, cols]
            row += len(source.rows)
        result.layers[layer_idx].set_buffers(keys, values, length)
    shifts = [length - width - s.first_column for s, width in zip(sources, widths, strict=True)]
    return result, shifts

"""The ``replay`` batch group: each step's DPO pairs packed into rows of their own.

A pair is two sequences, ``context + chosen`` and ``context + rejected``; both go into the same
micro-batch (the loss needs both sides of a pair), next-fit into rows of ``seq_len``. Pairs are
dealt to the step's micro-batches round-robin, in the order ``build`` is called (rank by rank), so
every rank gets about as many. A pair whose longer sequence does not fit ``seq_len`` is left out
and counted (``replay/pack_dropped``). A ``HeldOutPair`` is packed like any pair, flagged in the
group's ``heldout`` so the trainer scores it without training on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from prime_composer.orchestrator.packing import Piece, Placement, next_fit
from prime_composer.orchestrator.sample import Sample
from prime_composer.teacher.client import Pair
from prime_composer.transport.batch import BatchGroup
from prime_composer.transport.groups import ReplayGroup


@dataclass(frozen=True)
class HeldOutPair:
    """A pair of the held-out set (``orchestrator.replay.heldout_pairs``): scored, never trained on."""

    pair: Pair


class ReplayPacker:
    """``GroupPacker`` of the ``replay`` group."""

    name = ReplayGroup.name

    def __init__(self) -> None:
        self._queues: list[list[tuple[Pair, bool]]] = []
        self._dropped = 0
        self._packed = 0
        self._heldout = 0
        self._next = 0

    def begin(self, items: list[Any], num_micro_batches: int) -> None:
        self._queues = [[] for _ in range(num_micro_batches)]
        self._dropped = self._packed = self._heldout = 0
        self._next = 0
        for i, item in enumerate(items):
            held = isinstance(item, HeldOutPair)
            self._queues[i % num_micro_batches].append((item.pair if held else item, held))

    def fit(self, sample: Sample, piece: Piece, seq_len: int) -> None:
        return None  # built from the source's pairs, not from the samples

    def build(
        self, placements: list[Placement], num_rows: int, seq_len: int, pad_token_id: int
    ) -> ReplayGroup | None:
        pairs = self._queues[self._next] if self._next < len(self._queues) else []
        self._next += 1
        fitting = []
        heldout = []
        for pair, held in pairs:
            longest = len(pair.context_ids) + max(len(pair.chosen_ids), len(pair.rejected_ids))
            if longest > seq_len or not pair.chosen_ids or not pair.rejected_ids or not pair.context_ids:
                self._dropped += 1
            else:
                fitting.append(pair)
                heldout.append(held)
        if not fitting:
            return None
        self._heldout += sum(heldout)
        self._packed += len(fitting) - sum(heldout)
        # (token ids, number of side tokens at the end, pair index, chosen?, side ref logprobs)
        sequences: list[tuple[list[int], int, int, bool, list[float]]] = []
        for index, pair in enumerate(fitting):
            for side, refs, chosen in (
                (pair.chosen_ids, pair.ref_chosen_logprobs, True),
                (pair.rejected_ids, pair.ref_rejected_logprobs, False),
            ):
                sequences.append((list(pair.context_ids) + list(side), len(side), index, chosen, refs))
        rows = next_fit(sequences, lambda sequence: len(sequence[0]), seq_len)
        shape = (len(rows), seq_len)
        input_ids = torch.full(shape, pad_token_id, dtype=torch.long)
        position_ids = torch.zeros(shape, dtype=torch.long)
        side_mask = torch.zeros(shape, dtype=torch.bool)
        pair_ids = torch.full(shape, -1, dtype=torch.long)
        is_chosen = torch.zeros(shape, dtype=torch.bool)
        ref_logprobs = torch.zeros(shape, dtype=torch.float32)
        for r, row in enumerate(rows):
            start = 0
            for ids, num_side, index, chosen, refs in row:
                end = start + len(ids)
                input_ids[r, start:end] = torch.tensor(ids)
                position_ids[r, start:end] = torch.arange(end - start)
                tokens = slice(end - num_side, end)
                side_mask[r, tokens] = True
                pair_ids[r, tokens] = index
                is_chosen[r, tokens] = chosen
                ref_logprobs[r, tokens] = torch.tensor(refs, dtype=torch.float32)
                start = end
            position_ids[r, start:] = torch.arange(seq_len - start)
        return ReplayGroup(
            input_ids=input_ids,
            position_ids=position_ids,
            side_mask=side_mask,
            pair_ids=pair_ids,
            is_chosen=is_chosen,
            ref_logprobs=ref_logprobs,
            label_smoothing=torch.tensor([p.label_smoothing for p in fitting], dtype=torch.float32),
            heldout=torch.tensor(heldout, dtype=torch.bool),
        )

    def metrics(
        self, samples: list[Sample], pieces: list[Piece], groups: list[BatchGroup]
    ) -> dict[str, float]:
        return {
            "replay/packed_pairs": self._packed,
            "replay/packed_heldout": self._heldout,
            "replay/pack_dropped": self._dropped,
            "replay/rows": sum(g.input_ids.shape[0] for g in groups if isinstance(g, ReplayGroup)),
        }

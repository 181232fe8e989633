"""The ``sdpo`` batch group: teacher rows packed beside their students (``transport.groups.SDPOGroup``).

A hinted sample (``Sample.channels["sdpo"]``, ``target.py``) marks its target tokens in the group's ``student_mask``, clipped
to what its row kept after truncation, and its teacher sequence (``teacher_prefix_ids`` + the
same target tokens) goes into the teacher rows of the *same* micro-batch. Teacher sequences are
packed next-fit in the order their students appear in the micro-batch (row by row, left to right),
which keeps the k-th target token of the student rows and of the teacher rows the same token.
Teacher rows are as many as needed; a micro-batch without a hinted sample gets no group.

A hinted sample whose target falls outside the kept tokens, or whose teacher sequence does not fit
``seq_len``, trains with RL only and is counted (``sdpo/pack_dropped``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from prime_composer.orchestrator.packing import Piece, Placement, next_fit
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.sdpo.target import sdpo_target
from prime_composer.transport.batch import BatchGroup
from prime_composer.transport.groups import SDPOGroup


@dataclass(frozen=True)
class _Target:
    """A piece's SDPO contribution."""

    start: int
    """First target token, as an index into the piece's ``input_ids``."""
    end: int
    teacher_ids: list[int]
    """Teacher sequence: hinted prefix + the target tokens, which are its last ``end - start``."""


class SDPOPacker:
    """``GroupPacker`` of the ``sdpo`` group."""

    name = SDPOGroup.name

    def begin(self, items: list[Any], num_micro_batches: int) -> None:
        if items:
            raise ValueError("the sdpo group is built from hinted samples; it takes no source items")

    def fit(self, sample: Sample, piece: Piece, seq_len: int) -> _Target | None:
        target = sdpo_target(sample)
        if target is None:
            return None
        start, end = target.span[0], min(target.span[1], piece.completion_len)
        teacher = list(target.teacher_prefix_ids) + list(sample.completion_ids[start:end])
        if end <= start or len(teacher) > seq_len:
            return None
        return _Target(piece.num_prompt + start, piece.num_prompt + end, teacher)

    def build(
        self, placements: list[Placement], num_rows: int, seq_len: int, pad_token_id: int
    ) -> SDPOGroup | None:
        hinted = [(p, t) for p in placements if isinstance(t := p.piece.extras.get(self.name), _Target)]
        if not hinted:
            return None
        student_mask = torch.zeros((num_rows, seq_len), dtype=torch.bool)
        for placement, target in hinted:
            student_mask[placement.row, placement.start + target.start : placement.start + target.end] = True
        # Next-fit in student order (placements are row by row, left to right).
        packed = next_fit([target for _, target in hinted], lambda t: len(t.teacher_ids), seq_len)
        input_ids = torch.full((len(packed), seq_len), pad_token_id, dtype=torch.long)
        position_ids = torch.zeros((len(packed), seq_len), dtype=torch.long)
        target_mask = torch.zeros((len(packed), seq_len), dtype=torch.bool)
        for r, row in enumerate(packed):
            start = 0
            for target in row:
                end = start + len(target.teacher_ids)
                input_ids[r, start:end] = torch.tensor(target.teacher_ids)
                position_ids[r, start:end] = torch.arange(end - start)
                target_mask[r, end - (target.end - target.start) : end] = True
                start = end
            position_ids[r, start:] = torch.arange(seq_len - start)
        return SDPOGroup(
            student_mask=student_mask,
            teacher_input_ids=input_ids,
            teacher_position_ids=position_ids,
            teacher_target_mask=target_mask,
        )

    def metrics(
        self, samples: list[Sample], pieces: list[Piece], groups: list[BatchGroup]
    ) -> dict[str, float]:
        packed = sum(self.name in p.extras for p in pieces)
        kept_ids = {p.sample_id for p in pieces}
        hinted_kept = sum(1 for i, s in enumerate(samples) if sdpo_target(s) is not None and i in kept_ids)
        return {
            "sdpo/packed_samples": packed,
            "sdpo/teacher_rows": sum(
                g.teacher_input_ids.shape[0] for g in groups if isinstance(g, SDPOGroup)
            ),
            "sdpo/pack_dropped": hinted_kept - packed,
        }

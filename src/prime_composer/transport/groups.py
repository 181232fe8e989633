"""The built-in batch groups: term-specific tensors a micro-batch may carry (see ``batch.py``).

``SDPOGroup`` (loss term ``trainer/losses/sdpo_term.py``): for the hinted samples of the micro-batch,
``student_mask`` marks on the core rows the target-turn tokens, and the teacher rows
``teacher_*`` (``[Rt, T]``, ``Rt >= 1``) hold each hinted sample's teacher sequence (hinted prefix +
the same target tokens) with ``teacher_target_mask`` on those tokens. Alignment rule: the k-th
True of ``student_mask`` (row-major) is the same token as the k-th True of ``teacher_target_mask``.
A micro-batch with no hinted sample has no ``sdpo`` group.

``ReplayGroup`` (loss term ``trainer/losses/replay_term.py``): the replay channel's preference pairs,
in rows of their own (below).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from prime_composer.transport.batch import BatchFormatError, BatchGroup, MicroBatch, register_group


@register_group
@dataclass
class SDPOGroup(BatchGroup):
    """SDPO hint distillation: student target tokens and the teacher rows that score them."""

    name: ClassVar[str] = "sdpo"
    dtypes: ClassVar[dict[str, torch.dtype]] = {
        "student_mask": torch.bool,
        "teacher_input_ids": torch.long,
        "teacher_position_ids": torch.long,
        "teacher_target_mask": torch.bool,
    }

    student_mask: torch.Tensor
    """``[R, T]``: target tokens of hinted samples on the core rows (a subset of ``loss_mask``)."""
    teacher_input_ids: torch.Tensor
    """``[Rt, T]`` packed teacher sequences: hinted prefix + the same target tokens."""
    teacher_position_ids: torch.Tensor
    """``[Rt, T]`` positions of the teacher rows, restarting at 0 for every packed sequence."""
    teacher_target_mask: torch.Tensor
    """``[Rt, T]`` True on the teacher's copies of the ``student_mask`` tokens, in the same order."""

    @property
    def num_tokens(self) -> int:
        return int(self.student_mask.sum())

    def check(self, mb: MicroBatch) -> None:
        core_shape = mb.input_ids.shape
        if self.student_mask.shape != core_shape:
            raise BatchFormatError(
                f"sdpo.student_mask must have the core shape {tuple(core_shape)}, got "
                f"{tuple(self.student_mask.shape)}"
            )
        rows = self.teacher_input_ids.shape
        if len(rows) != 2 or rows[0] < 1 or rows[1] != core_shape[1]:
            raise BatchFormatError(
                f"sdpo.teacher_input_ids must be [Rt >= 1, {core_shape[1]}], got {tuple(rows)}"
            )
        for name in ("teacher_position_ids", "teacher_target_mask"):
            if getattr(self, name).shape != rows:
                raise BatchFormatError(
                    f"sdpo.{name} must have the shape of sdpo.teacher_input_ids {tuple(rows)}, got "
                    f"{tuple(getattr(self, name).shape)}"
                )
        if bool((self.student_mask & ~mb.loss_mask).any()):
            raise BatchFormatError("sdpo.student_mask marks tokens outside loss_mask")
        num_student, num_teacher = self.num_tokens, int(self.teacher_target_mask.sum())
        if num_student != num_teacher or num_student == 0:
            raise BatchFormatError(
                f"sdpo.student_mask has {num_student} tokens and sdpo.teacher_target_mask {num_teacher}: "
                "they must align one to one (and a group without target tokens is left out)"
            )


@register_group
@dataclass
class ReplayGroup(BatchGroup):
    """Replay pairs (the teacher service's DPO pairs): each pair is two sequences, ``context +
    chosen`` and ``context + rejected``, packed in their own rows ``[Rd, T]``.

    ``side_mask`` marks the tokens of the two sides (the ones the policy's log-probability is summed
    over), ``pair_ids`` says which pair (0..P-1 in this micro-batch) a side token belongs to,
    ``is_chosen`` which side, and ``ref_logprobs`` holds the reference model's logprob of each side
    token (computed once by the teacher service). ``label_smoothing`` is per pair, ``[P]``, and so
    is ``heldout``: pairs of the held-out set, scored for metrics and never trained on.
    """

    name: ClassVar[str] = "replay"
    dtypes: ClassVar[dict[str, torch.dtype]] = {
        "input_ids": torch.long,
        "position_ids": torch.long,
        "side_mask": torch.bool,
        "pair_ids": torch.long,
        "is_chosen": torch.bool,
        "ref_logprobs": torch.float32,
        "label_smoothing": torch.float32,
        "heldout": torch.bool,
    }

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    side_mask: torch.Tensor
    pair_ids: torch.Tensor
    is_chosen: torch.Tensor
    ref_logprobs: torch.Tensor
    label_smoothing: torch.Tensor
    heldout: torch.Tensor

    @property
    def num_pairs(self) -> int:
        return int(self.label_smoothing.shape[0])

    def check(self, mb: MicroBatch) -> None:
        rows = self.input_ids.shape
        if len(rows) != 2 or rows[0] < 1 or rows[1] != mb.input_ids.shape[1]:
            raise BatchFormatError(
                f"replay.input_ids must be [Rd >= 1, {mb.input_ids.shape[1]}], got {tuple(rows)}"
            )
        for name in ("position_ids", "side_mask", "pair_ids", "is_chosen", "ref_logprobs"):
            if getattr(self, name).shape != rows:
                raise BatchFormatError(f"replay.{name} must have the shape of replay.input_ids {tuple(rows)}")
        num_pairs = self.num_pairs
        if self.label_smoothing.dim() != 1 or num_pairs < 1:
            raise BatchFormatError("replay.label_smoothing must be [P] with P >= 1 pairs")
        if self.heldout.shape != self.label_smoothing.shape:
            raise BatchFormatError("replay.heldout must be [P], one flag per pair like label_smoothing")
        if bool((self.side_mask != (self.pair_ids >= 0)).any()):
            raise BatchFormatError("replay.pair_ids must be set exactly on the side_mask tokens")
        if bool((self.side_mask & (self.position_ids == 0)).any()):
            raise BatchFormatError(
                "replay.side_mask marks the first token of a sequence, which nothing predicts"
            )
        ids = self.pair_ids[self.side_mask]
        if ids.numel() and int(ids.max()) >= num_pairs:
            raise BatchFormatError(
                f"replay.pair_ids go up to {int(ids.max())} but there are {num_pairs} pairs"
            )
        for side in (True, False):
            present = torch.unique(self.pair_ids[self.side_mask & (self.is_chosen == side)])
            if present.numel() != num_pairs:
                which = "chosen" if side else "rejected"
                raise BatchFormatError(f"replay: {num_pairs - present.numel()} pairs have no {which} tokens")
        if not bool(torch.isfinite(self.ref_logprobs).all() & torch.isfinite(self.label_smoothing).all()):
            raise BatchFormatError("replay.ref_logprobs / label_smoothing hold non-finite values")

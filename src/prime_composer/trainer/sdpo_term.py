"""The SDPO term inside one trainer step: teacher forward, aligned logits, loss, metrics.

``train_step`` builds one ``SDPOTerm`` per step when ``loss.sdpo.weight > 0`` (with weight 0 it is
never built: no teacher forward, no extra collective). Per micro-batch it

1. runs the teacher forward on the micro-batch's teacher rows (no grad) *before* the student
   forward, so the teacher's activations are freed before the student's are alive, and keeps only
   the ``[N, V]`` logits at the target tokens;
2. takes the student's logits at ``sdpo_mask`` (the k-th True of ``sdpo_mask`` and the k-th True of
   ``teacher_target_mask`` are the same token, see ``transport/batch.py``);
3. returns ``sdpo_loss_rows`` normalized by the step's global number of SDPO tokens.

Collectives: the normalizer is all-reduced over ranks, and so is the list of micro-batches that
need a teacher forward. Under FSDP the teacher forward all-gathers parameters, so a rank whose
micro-batch has no hinted sample still runs a one-row dummy forward when another rank's does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from prime_composer.config.loss import SDPOLossConfig
from prime_composer.trainer.losses.aggregate import token_normalizer
from prime_composer.trainer.losses.sdpo import sdpo_loss_rows
from prime_composer.trainer.teacher import TeacherModel
from prime_composer.transport.batch import MicroBatch


class SDPOTerm:
    """The SDPO part of one step for one rank's micro-batches."""

    def __init__(self, teacher: TeacherModel, cfg: SDPOLossConfig, micro_batches: list[MicroBatch]) -> None:
        self.teacher = teacher
        self.cfg = cfg
        self.normalizer = token_normalizer([mb.sdpo_mask for mb in micro_batches])  # type: ignore[misc]
        needed = torch.tensor([bool(mb.sdpo_mask.any()) for mb in micro_batches], dtype=torch.float32)  # type: ignore[union-attr]
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(needed, op=dist.ReduceOp.MAX)
        self.run_teacher = [bool(x) for x in needed.tolist()]

    def teacher_logits(self, index: int, mb: MicroBatch) -> Tensor | None:
        """``[N, V]`` teacher logits (temperature-scaled) for micro-batch ``index``, or None when no
        rank needs a teacher forward for it."""
        if not self.run_teacher[index]:
            return None
        ids, positions, mask = mb.teacher_input_ids, mb.teacher_position_ids, mb.teacher_target_mask
        assert ids is not None and positions is not None and mask is not None  # filled by MicroBatch
        if ids.shape[0] == 0:
            # Another rank needs this forward (FSDP collectives): one padding row, no target.
            ids = torch.zeros((1, mb.input_ids.shape[1]), dtype=torch.long, device=mb.input_ids.device)
            positions = torch.arange(ids.shape[1], device=ids.device)[None]
            mask = torch.zeros_like(ids, dtype=torch.bool)
        return self.teacher.logits(ids, positions, mask, mb.temperature)

    def loss(
        self, student_logits: Tensor, mb: MicroBatch, teacher_logits: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The micro-batch's share of the SDPO loss (not yet multiplied by the weight).

        ``student_logits`` are the student's ``[R, T, V]`` temperature-scaled logits aligned with the
        tokens (``packed_token_logprobs(..., return_logits=True)``). Metrics include
        ``sdpo/kl_teacher_student``, KL(P_teacher || P_student) over the whole vocabulary whatever
        ``beta`` and ``top_k`` (the loss computes it in the same pass).
        """
        student = student_logits[mb.sdpo_mask.to(student_logits.device)]  # type: ignore[union-attr]
        if student.shape[0] != teacher_logits.shape[0]:
            raise ValueError(
                f"SDPO: {student.shape[0]} student target tokens but {teacher_logits.shape[0]} teacher ones "
                "(sdpo_mask and teacher_target_mask must align one to one)"
            )
        # Both sides are already divided by the sampling temperature.
        return sdpo_loss_rows(student, teacher_logits, self.cfg, 1.0, self.normalizer)

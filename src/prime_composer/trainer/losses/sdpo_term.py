"""The SDPO term of the objective: teacher forward, aligned logits, generalized JSD (``sdpo.py``).

Built only when ``loss.sdpo.weight > 0`` (with weight 0: no teacher copy, no teacher forward, no
extra collective). The teacher is a ``PolicyCopy`` of kind ``loss.sdpo.teacher`` (``live``,
``ema`` or ``frozen``) from the step's ``TermContext``. Per step it computes the global number of
SDPO target tokens; per micro-batch it

1. runs the teacher forward on the micro-batch's teacher rows (``transport.groups.SDPOGroup``, no
   grad) *before* the student forward, so the teacher's activations are freed before the
   student's are alive, and keeps only the ``[N, V]`` logits at the target tokens (on one
   process, short rows run trimmed of their trailing padding: ``_target_logits``);
2. asks the student forward for its logits at ``student_mask`` (the k-th True of ``student_mask``
   and the k-th True of ``teacher_target_mask`` are the same token);
3. returns ``sdpo_loss_rows`` normalized by the step's global number of SDPO tokens.

Collectives: the normalizer is all-reduced over ranks, and so is the list of micro-batches that
need a teacher forward. Under FSDP the teacher forward all-gathers parameters, so a rank whose
micro-batch has no hinted sample still runs a one-row dummy forward when another rank's does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from prime_composer.config.loss import SDPOLossConfig
from prime_composer.trainer.forward import ForwardOutput
from prime_composer.trainer.losses.aggregate import token_normalizer
from prime_composer.trainer.losses.base import LossTerm, TermContext, register_term
from prime_composer.trainer.losses.sdpo import sdpo_loss_rows
from prime_composer.trainer.policy_copy import PolicyCopy
from prime_composer.transport.batch import MicroBatch
from prime_composer.transport.groups import SDPOGroup


@register_term("sdpo")
class SDPOTerm(LossTerm):
    """``trainer.loss.sdpo``: hint distillation from the hinted teacher to the unhinted student."""

    @classmethod
    def build(cls, cfg: SDPOLossConfig, ctx: TermContext) -> SDPOTerm:
        return cls(cfg, ctx.copy(cfg.teacher, cfg.ema_rate))

    def __init__(self, cfg: SDPOLossConfig, teacher: PolicyCopy) -> None:
        super().__init__(cfg.weight)
        self.cfg = cfg
        self.teacher = teacher
        self.normalizer = 0.0
        self._run_teacher: list[bool] = []
        self._teacher_logits: Tensor | None = None

    def logits_mask(self, mb: MicroBatch) -> Tensor | None:
        group = mb.group(SDPOGroup)
        return group.student_mask if group is not None and self._teacher_logits is not None else None

    def begin_step(self, micro_batches: Sequence[MicroBatch]) -> None:
        groups = [mb.group(SDPOGroup) for mb in micro_batches]
        masks = [g.student_mask if g is not None else torch.zeros((1, 1), dtype=torch.bool) for g in groups]
        self.normalizer = token_normalizer(masks)
        needed = torch.tensor([g is not None for g in groups], dtype=torch.float32)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(needed, op=dist.ReduceOp.MAX)
        self._run_teacher = [bool(x) for x in needed.tolist()]

    def prepare(self, index: int, mb: MicroBatch) -> None:
        """The ``[N, V]`` teacher logits (temperature-scaled) of micro-batch ``index``, when any rank
        needs a teacher forward for it."""
        self._teacher_logits = None
        if not self._run_teacher[index]:
            return
        group = mb.group(SDPOGroup)
        if group is None:
            # Another rank needs this forward (FSDP collectives): one padding row, no target.
            ids = torch.zeros((1, mb.input_ids.shape[1]), dtype=torch.long, device=mb.input_ids.device)
            positions = torch.arange(ids.shape[1], device=ids.device)[None]
            mask = torch.zeros_like(ids, dtype=torch.bool)
        else:
            ids, positions, mask = (
                group.teacher_input_ids,
                group.teacher_position_ids,
                group.teacher_target_mask,
            )
        self._teacher_logits = self._target_logits(ids, positions, mask, mb.temperature)

    def _target_logits(self, ids: Tensor, positions: Tensor, mask: Tensor, temperature: float) -> Tensor:
        """The teacher's ``[N, V]`` target logits, skipping the padding at the end of short rows.

        Teacher rows are ``seq_len`` wide, and next-fit packing leaves the last one (and any row the
        next sequence did not fit) partly padding: a row's content ends at its last target token.
        On one process, rows whose content fills at most half of the longest row's forward on their
        own, trimmed to their longest content; the rest keep one batch at that width. Rows do not
        see each other and a row's content does not see its trailing padding (causal attention), so
        each target's logits are the same computation. Under ``torch.distributed`` every rank must
        run the same number of forwards (FSDP all-gathers per forward): one forward, untrimmed.
        """
        if dist.is_available() and dist.is_initialized():
            return self.teacher.target_logits(ids, positions, mask, temperature)
        lengths = mask.shape[1] - mask.flip(1).int().argmax(1)  # last target + 1; rows have one
        width = int(lengths.max())
        short = lengths <= width // 2
        if not bool(short.any()) or bool(short.all()):
            w = width
            return self.teacher.target_logits(ids[:, :w], positions[:, :w], mask[:, :w], temperature)
        parts: list[Tensor | None] = [None] * ids.shape[0]
        for group in (~short, short):
            rows = group.nonzero().view(-1)
            w = int(lengths[rows].max())
            logits = self.teacher.target_logits(
                ids[rows, :w], positions[rows, :w], mask[rows, :w], temperature
            )
            counts = mask[rows, :w].sum(1).tolist()
            for row, part in zip(rows.tolist(), logits.split(counts), strict=True):
                parts[row] = part
        return torch.cat([p for p in parts if p is not None])

    def loss(self, index: int, mb: MicroBatch, out: ForwardOutput) -> tuple[Tensor, dict[str, Tensor]]:
        """The micro-batch's share of the SDPO loss (not yet multiplied by the weight).

        Metrics include ``sdpo/kl_teacher_student``, KL(P_teacher || P_student) over the whole
        vocabulary whatever ``beta`` and ``top_k`` (the loss computes it in the same pass).
        """
        teacher, self._teacher_logits = self._teacher_logits, None
        if teacher is None:  # no rank has a hinted sample in this micro-batch
            return out.logprobs.new_zeros(()), {}
        # A rank that only ran the dummy teacher row has no target: an empty loss, but the same
        # metric keys as the other ranks (their [sum, count] pairs are reduced together).
        student = out.logits.get(self.name, teacher.new_zeros((0, teacher.shape[-1])))
        if student.shape[0] != teacher.shape[0]:
            raise ValueError(
                f"SDPO: {student.shape[0]} student target tokens but {teacher.shape[0]} teacher ones "
                "(sdpo.student_mask and sdpo.teacher_target_mask must align one to one)"
            )
        # Both sides are already divided by the sampling temperature.
        return sdpo_loss_rows(student, teacher, self.cfg, 1.0, self.normalizer)

    def step_metrics(self) -> dict[str, float]:
        return {"sdpo/num_tokens": self.normalizer}

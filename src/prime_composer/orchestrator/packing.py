"""Pack one step's samples into equal numbers of micro-batches per trainer rank.

1. Fit: a sample is ``prompt + completion``. One longer than ``seq_len`` is truncated from the
   completion end (its mask and logprobs cut with it) and reported in ``truncated_sample_ids``:
   the trainer still learns from the part it sees, with the advantage the whole rollout earned.
   A sample whose prompt leaves no room for a completion token, or that has no policy token left
   to train on, is dropped and reported in ``dropped_sample_ids``.
2. Rows: first-fit-decreasing bin packing of the samples into rows of ``seq_len`` tokens.
3. Ranks: rows, largest first, go to the rank with the fewest tokens that still has room, where
   every rank holds at most ``micro_batches_per_rank * micro_batch_size`` rows.
4. Micro-batches: each rank's rows are cut into micro-batches of up to ``micro_batch_size`` rows;
   ranks with fewer are topped up with one-row all-padding micro-batches, because every rank must
   run the same number of forward/backward passes (FSDP collectives).

Rows are padded to ``seq_len`` so shapes never change from step to step. The step-level counts
in every ``MicroBatch`` are global, so splitting the same samples as 1 rank x 4 micro-batches or
2 ranks x 2 gives the same normalised gradient.

SDPO: a sample with a hint (``Sample.sdpo_span``, set by ``orchestrator.hints``) marks its target
tokens in ``sdpo_mask`` (clipped to what the student row kept), and its teacher sequence
(``teacher_prefix_ids`` + the same target tokens) goes into the teacher rows of the *same*
micro-batch. Teacher sequences are packed next-fit in the order their students appear in the
micro-batch (row by row, left to right), which keeps the k-th target token of the student rows and
of the teacher rows the same token. Teacher rows are as many as needed (``Rt``, 0 without hints).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from prime_composer.orchestrator.sample import Sample
from prime_composer.transport.batch import MicroBatch


@dataclass
class PackingStats:
    """What packing did to a step, for logs."""

    num_rows: int = 0
    """Rows holding at least one sample (padding rows not counted)."""
    num_padding_micro_batches: int = 0
    """All-padding micro-batches added so every rank has the same count."""
    fill_ratio: float = 0.0
    """Sample tokens / (rows x seq_len) over the non-padding rows."""
    truncated_sample_ids: list[int] = field(default_factory=list)
    """Samples cut from the completion end to fit ``seq_len``."""
    dropped_sample_ids: list[int] = field(default_factory=list)
    """Samples left out: the prompt alone fills ``seq_len``, or no policy token remains."""
    num_sdpo_samples: int = 0
    """Packed samples with an SDPO target."""
    num_teacher_rows: int = 0
    """SDPO teacher rows over all micro-batches."""
    sdpo_dropped_sample_ids: list[int] = field(default_factory=list)
    """Hinted samples whose target fell outside the kept tokens, or whose teacher sequence does not
    fit ``seq_len`` (trained with RL only)."""


@dataclass
class _Piece:
    """One sample cut to fit, flattened to the per-token values the micro-batch holds."""

    sample_id: int
    input_ids: list[int]
    loss_mask: list[bool]
    advantages: list[float]
    logprobs: list[float]
    completion_len: int
    sdpo_range: tuple[int, int] | None = None
    """SDPO target tokens as ``input_ids[start:end]``; None without a hint."""
    teacher_ids: list[int] | None = None
    """Teacher sequence: hinted prefix + the target tokens, which are its last ``end - start``."""


def _fit(sample_id: int, sample: Sample, seq_len: int) -> tuple[_Piece | None, bool]:
    """Cut a sample to ``seq_len`` tokens; returns ``(piece or None if dropped, was_truncated)``."""
    num_prompt = len(sample.prompt_ids)
    keep = min(len(sample.completion_ids), seq_len - num_prompt)
    truncated = keep < len(sample.completion_ids)
    if keep <= 0 or not any(sample.completion_mask[:keep]):
        return None, truncated
    mask = [False] * num_prompt + [m == 1 for m in sample.completion_mask[:keep]]
    piece = _Piece(
        sample_id=sample_id,
        input_ids=list(sample.prompt_ids) + list(sample.completion_ids[:keep]),
        loss_mask=mask,
        advantages=[sample.advantage if m else 0.0 for m in mask],
        logprobs=[0.0] * num_prompt + list(sample.completion_logprobs[:keep]),
        completion_len=keep,
    )
    if sample.sdpo_span is not None and sample.teacher_prefix_ids is not None:
        start, end = sample.sdpo_span[0], min(sample.sdpo_span[1], keep)
        teacher = list(sample.teacher_prefix_ids) + list(sample.completion_ids[start:end])
        if end > start and len(teacher) <= seq_len:
            piece.sdpo_range = (num_prompt + start, num_prompt + end)
            piece.teacher_ids = teacher
    return piece, truncated


def _first_fit_decreasing(pieces: list[_Piece], seq_len: int) -> list[list[_Piece]]:
    rows: list[list[_Piece]] = []
    used: list[int] = []
    # Longest first; ties by sample id so the packing is deterministic.
    for piece in sorted(pieces, key=lambda p: (-len(p.input_ids), p.sample_id)):
        n = len(piece.input_ids)
        for i in range(len(rows)):
            if used[i] + n <= seq_len:
                rows[i].append(piece)
                used[i] += n
                break
        else:
            rows.append([piece])
            used.append(n)
    return rows


def _assign_to_ranks(
    rows: list[list[_Piece]], num_ranks: int, max_rows_per_rank: int
) -> list[list[list[_Piece]]]:
    def num_tokens(row: list[_Piece]) -> int:
        return sum(len(p.input_ids) for p in row)

    ranks: list[list[list[_Piece]]] = [[] for _ in range(num_ranks)]
    tokens = [0] * num_ranks
    for row in sorted(rows, key=num_tokens, reverse=True):
        open_ranks = [r for r in range(num_ranks) if len(ranks[r]) < max_rows_per_rank]
        rank = min(open_ranks, key=lambda r: (tokens[r], r))
        ranks[rank].append(row)
        tokens[rank] += num_tokens(row)
    return ranks


def _teacher_rows(
    rows: list[list[_Piece]], seq_len: int, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher ``(input_ids, position_ids, target_mask)`` ``[Rt, seq_len]`` for the hinted pieces of
    ``rows``, next-fit in student order (row by row, left to right) so the target tokens line up."""
    sequences: list[tuple[list[int], int]] = []  # (teacher ids, number of target tokens at the end)
    for row in rows:
        for piece in row:
            if piece.sdpo_range is not None and piece.teacher_ids is not None:
                sequences.append((piece.teacher_ids, piece.sdpo_range[1] - piece.sdpo_range[0]))
    packed: list[list[tuple[list[int], int]]] = []
    used = seq_len
    for ids, num_target in sequences:
        if used + len(ids) > seq_len:
            packed.append([])
            used = 0
        packed[-1].append((ids, num_target))
        used += len(ids)
    input_ids = torch.full((len(packed), seq_len), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((len(packed), seq_len), dtype=torch.long)
    target_mask = torch.zeros((len(packed), seq_len), dtype=torch.bool)
    for r, teacher_row in enumerate(packed):
        start = 0
        for ids, num_target in teacher_row:
            end = start + len(ids)
            input_ids[r, start:end] = torch.tensor(ids)
            position_ids[r, start:end] = torch.arange(end - start)
            target_mask[r, end - num_target : end] = True
            start = end
        position_ids[r, start:] = torch.arange(seq_len - start)
    return input_ids, position_ids, target_mask


def _micro_batch(
    rows: list[list[_Piece]], seq_len: int, pad_token_id: int, meta: dict[str, int | float]
) -> MicroBatch:
    """Build the tensors of one micro-batch; an empty ``rows`` gives one all-padding row."""
    num_rows = max(1, len(rows))
    input_ids = torch.full((num_rows, seq_len), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((num_rows, seq_len), dtype=torch.long)
    loss_mask = torch.zeros((num_rows, seq_len), dtype=torch.bool)
    advantages = torch.zeros((num_rows, seq_len), dtype=torch.float32)
    logprobs = torch.zeros((num_rows, seq_len), dtype=torch.float32)
    sample_ids = torch.full((num_rows, seq_len), -1, dtype=torch.long)
    sdpo_mask = torch.zeros((num_rows, seq_len), dtype=torch.bool)
    for r, row in enumerate(rows):
        start = 0
        for piece in row:
            end = start + len(piece.input_ids)
            input_ids[r, start:end] = torch.tensor(piece.input_ids)
            position_ids[r, start:end] = torch.arange(end - start)
            loss_mask[r, start:end] = torch.tensor(piece.loss_mask)
            advantages[r, start:end] = torch.tensor(piece.advantages)
            logprobs[r, start:end] = torch.tensor(piece.logprobs)
            sample_ids[r, start:end] = piece.sample_id
            if piece.sdpo_range is not None:
                sdpo_mask[r, start + piece.sdpo_range[0] : start + piece.sdpo_range[1]] = True
            start = end
        # The padding tail is numbered like one more sample, so it attends only to itself.
        position_ids[r, start:] = torch.arange(seq_len - start)
    if not rows:
        position_ids[0] = torch.arange(seq_len)
    teacher_ids, teacher_positions, teacher_mask = _teacher_rows(rows, seq_len, pad_token_id)
    return MicroBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        loss_mask=loss_mask,
        advantages=advantages,
        inference_logprobs=logprobs,
        sample_ids=sample_ids,
        sdpo_mask=sdpo_mask,
        teacher_input_ids=teacher_ids,
        teacher_position_ids=teacher_positions,
        teacher_target_mask=teacher_mask,
        **meta,  # type: ignore[arg-type]
    )


def pack_step(
    samples: list[Sample],
    seq_len: int,
    micro_batch_size: int,
    num_ranks: int,
    pad_token_id: int,
    temperature: float = 1.0,
) -> tuple[list[list[MicroBatch]], PackingStats]:
    """Pack a step's samples; returns ``(micro-batches of each rank, stats)``.

    Every rank gets the same number of micro-batches (at least one). The sample id of a token is
    the index of its sample in ``samples``. ``temperature`` is the sampling temperature, passed
    on so the trainer scales its logits the same way.
    """
    if seq_len < 1 or micro_batch_size < 1 or num_ranks < 1:
        raise ValueError(
            f"pack_step: seq_len ({seq_len}), micro_batch_size ({micro_batch_size}) and "
            f"num_ranks ({num_ranks}) must all be >= 1"
        )
    stats = PackingStats()
    pieces: list[_Piece] = []
    for sample_id, sample in enumerate(samples):
        piece, truncated = _fit(sample_id, sample, seq_len)
        if truncated:
            stats.truncated_sample_ids.append(sample_id)
        if piece is None:
            stats.dropped_sample_ids.append(sample_id)
        else:
            pieces.append(piece)
            if sample.sdpo_span is not None and piece.sdpo_range is None:
                stats.sdpo_dropped_sample_ids.append(sample_id)

    rows = _first_fit_decreasing(pieces, seq_len)
    num_micro_batches = math.ceil(len(rows) / micro_batch_size)
    micro_batches_per_rank = max(1, math.ceil(num_micro_batches / num_ranks))
    rank_rows = _assign_to_ranks(rows, num_ranks, micro_batches_per_rank * micro_batch_size)

    meta: dict[str, int | float] = {
        "temperature": temperature,
        "num_loss_tokens": sum(sum(p.loss_mask) for p in pieces),
        "num_samples": len(pieces),
        "max_completion_len": max((p.completion_len for p in pieces), default=0),
        "num_sdpo_tokens": sum(p.sdpo_range[1] - p.sdpo_range[0] for p in pieces if p.sdpo_range is not None),
    }
    rank_batches: list[list[MicroBatch]] = []
    for rows_of_rank in rank_rows:
        chunks = [
            rows_of_rank[i : i + micro_batch_size] for i in range(0, len(rows_of_rank), micro_batch_size)
        ]
        num_padding = micro_batches_per_rank - len(chunks)
        stats.num_padding_micro_batches += num_padding
        chunks += [[] for _ in range(num_padding)]
        rank_batches.append([_micro_batch(chunk, seq_len, pad_token_id, meta) for chunk in chunks])

    stats.num_rows = len(rows)
    stats.num_sdpo_samples = sum(p.sdpo_range is not None for p in pieces)
    stats.num_teacher_rows = sum(
        int(mb.teacher_input_ids.shape[0])
        for mbs in rank_batches
        for mb in mbs
        if mb.teacher_input_ids is not None
    )
    if rows:
        stats.fill_ratio = sum(len(p.input_ids) for p in pieces) / (len(rows) * seq_len)
    return rank_batches, stats

"""Pack one step's samples into equal numbers of micro-batches per trainer rank.

1. Fit: a sample is ``prompt + completion``. One longer than ``seq_len`` is truncated from the
   completion end (its mask and logprobs cut with it) and reported in ``truncated_sample_ids``:
   the trainer still learns from the part it sees, with the advantage the whole rollout earned
   (per token: ``Sample.token_advantages``, which per-step credit sets turn by turn).
   A sample whose prompt leaves no room for a completion token, or that has no policy token left
   to train on, is dropped and reported in ``dropped_sample_ids``.
2. Rows: first-fit-decreasing bin packing of the samples into rows of ``seq_len`` tokens.
3. Ranks: rows, largest first, go to the rank with the fewest tokens that still has room, where
   every rank holds at most ``micro_batches_per_rank * micro_batch_size`` rows.
4. Micro-batches: each rank's rows are cut into micro-batches of up to ``micro_batch_size`` rows;
   ranks with fewer are topped up with one-row all-padding micro-batches, because every rank must
   run the same number of forward/backward passes (FSDP collectives).

Rows are padded to ``seq_len`` so shapes never change from step to step. The trainer normalizes
by counts it takes over the whole step (all micro-batches and ranks), so splitting the same
samples as 1 rank x 4 micro-batches or 2 ranks x 2 gives the same gradient.

Groups: term-specific tensors (``transport/batch.py``) are built by ``GroupPacker``s passed to
``pack_step`` (e.g. ``orchestrator/sdpo/packing.py`` for SDPO's teacher rows). A packer sees each
sample once it is fitted (``fit``: what the sample contributes, cut to what the row kept) and each
micro-batch once its rows are laid out (``build``: the group's tensors, or None when none of its
samples contributed), and reports its own metrics. Core packing knows nothing about any term.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from prime_composer.orchestrator.sample import Sample
from prime_composer.transport.batch import BatchGroup, MicroBatch

T = TypeVar("T")


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
    group_metrics: dict[str, float] = field(default_factory=dict)
    """What the group packers report (``<group>/...`` names)."""

    def metrics(self) -> dict[str, float]:
        return {
            "pack/fill_ratio": self.fill_ratio,
            "pack/num_rows": self.num_rows,
            "pack/truncated": len(self.truncated_sample_ids),
            "pack/dropped": len(self.dropped_sample_ids),
            **self.group_metrics,
        }


@dataclass
class Piece:
    """One sample cut to fit, flattened to the per-token values the micro-batch holds."""

    sample_id: int
    num_prompt: int
    input_ids: list[int]
    loss_mask: list[bool]
    advantages: list[float]
    logprobs: list[float]
    completion_len: int
    """Completion tokens kept (after truncation)."""
    extras: dict[str, Any] = field(default_factory=dict)
    """What each group packer's ``fit`` returned for this piece, by group name (absent: nothing)."""


@dataclass(frozen=True)
class Placement:
    """Where a piece landed: row ``row`` of its micro-batch, starting at token ``start``."""

    piece: Piece
    row: int
    start: int


class GroupPacker(Protocol):
    """Builds one batch group (see the module docstring). One instance packs one step at a time."""

    name: str

    def begin(self, items: list[Any], num_micro_batches: int) -> None:
        """Start a step: ``items`` are what the batch source of the same name gave this step (none
        for groups built from the samples alone); ``build`` will be called ``num_micro_batches``
        times, rank by rank, and may hand the items out over those calls."""
        ...

    def fit(self, sample: Sample, piece: Piece, seq_len: int) -> Any | None:
        """What ``sample`` contributes to the group, given the ``piece`` core packing kept; None: nothing."""
        ...

    def build(
        self, placements: list[Placement], num_rows: int, seq_len: int, pad_token_id: int
    ) -> BatchGroup | None:
        """The group of one micro-batch of ``num_rows`` rows, or None when no placed piece contributes."""
        ...

    def metrics(
        self, samples: list[Sample], pieces: list[Piece], groups: list[BatchGroup]
    ) -> dict[str, float]:
        """The step's metrics for this group (``groups``: every group built this step)."""
        ...


def _fit(sample_id: int, sample: Sample, seq_len: int) -> tuple[Piece | None, bool]:
    """Cut a sample to ``seq_len`` tokens; returns ``(piece or None if dropped, was_truncated)``."""
    num_prompt = len(sample.prompt_ids)
    keep = min(len(sample.completion_ids), seq_len - num_prompt)
    truncated = keep < len(sample.completion_ids)
    if keep <= 0 or not any(sample.completion_mask[:keep]):
        return None, truncated
    mask = [False] * num_prompt + [m == 1 for m in sample.completion_mask[:keep]]
    piece = Piece(
        sample_id=sample_id,
        num_prompt=num_prompt,
        input_ids=list(sample.prompt_ids) + list(sample.completion_ids[:keep]),
        loss_mask=mask,
        advantages=[0.0] * num_prompt + sample.token_advantages()[:keep],
        logprobs=[0.0] * num_prompt + list(sample.completion_logprobs[:keep]),
        completion_len=keep,
    )
    return piece, truncated


def next_fit(items: Sequence[T], length: Callable[[T], int], seq_len: int) -> list[list[T]]:
    """``items`` in order, in rows of at most ``seq_len`` tokens: a new row whenever the next item
    does not fit the current one (keeps the order, which group packers rely on for alignment)."""
    rows: list[list[T]] = []
    used = seq_len
    for item in items:
        if used + length(item) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(item)
        used += length(item)
    return rows


def _first_fit_decreasing(pieces: list[Piece], seq_len: int) -> list[list[Piece]]:
    rows: list[list[Piece]] = []
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
    rows: list[list[Piece]], num_ranks: int, max_rows_per_rank: int
) -> list[list[list[Piece]]]:
    def num_tokens(row: list[Piece]) -> int:
        return sum(len(p.input_ids) for p in row)

    ranks: list[list[list[Piece]]] = [[] for _ in range(num_ranks)]
    tokens = [0] * num_ranks
    for row in sorted(rows, key=num_tokens, reverse=True):
        open_ranks = [r for r in range(num_ranks) if len(ranks[r]) < max_rows_per_rank]
        rank = min(open_ranks, key=lambda r: (tokens[r], r))
        ranks[rank].append(row)
        tokens[rank] += num_tokens(row)
    return ranks


def _micro_batch(
    rows: list[list[Piece]],
    seq_len: int,
    pad_token_id: int,
    temperature: float,
    packers: Sequence[GroupPacker],
) -> MicroBatch:
    """Build the tensors of one micro-batch; an empty ``rows`` gives one all-padding row."""
    num_rows = max(1, len(rows))
    input_ids = torch.full((num_rows, seq_len), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((num_rows, seq_len), dtype=torch.long)
    loss_mask = torch.zeros((num_rows, seq_len), dtype=torch.bool)
    advantages = torch.zeros((num_rows, seq_len), dtype=torch.float32)
    logprobs = torch.zeros((num_rows, seq_len), dtype=torch.float32)
    sample_ids = torch.full((num_rows, seq_len), -1, dtype=torch.long)
    placements: list[Placement] = []
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
            placements.append(Placement(piece, r, start))
            start = end
        # The padding tail is numbered like one more sample, so it attends only to itself.
        position_ids[r, start:] = torch.arange(seq_len - start)
    if not rows:
        position_ids[0] = torch.arange(seq_len)
    groups = {}
    for packer in packers:
        group = packer.build(placements, num_rows, seq_len, pad_token_id)
        if group is not None:
            groups[packer.name] = group
    return MicroBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        loss_mask=loss_mask,
        advantages=advantages,
        inference_logprobs=logprobs,
        sample_ids=sample_ids,
        temperature=temperature,
        groups=groups,
    )


def pack_step(
    samples: list[Sample],
    seq_len: int,
    micro_batch_size: int,
    num_ranks: int,
    pad_token_id: int,
    temperature: float = 1.0,
    packers: Sequence[GroupPacker] = (),
    extras: dict[str, list[Any]] | None = None,
) -> tuple[list[list[MicroBatch]], PackingStats]:
    """Pack a step's samples; returns ``(micro-batches of each rank, stats)``.

    Every rank gets the same number of micro-batches (at least one). The sample id of a token is
    the index of its sample in ``samples``. ``temperature`` is the sampling temperature, passed
    on so the trainer scales its logits the same way. ``packers`` build the batch groups;
    ``extras`` holds the batch sources' items by packer name.
    """
    extras = extras or {}
    unknown = set(extras) - {p.name for p in packers}
    if unknown:
        raise ValueError(f"pack_step: items for {sorted(unknown)} but no group packer of that name")
    if seq_len < 1 or micro_batch_size < 1 or num_ranks < 1:
        raise ValueError(
            f"pack_step: seq_len ({seq_len}), micro_batch_size ({micro_batch_size}) and "
            f"num_ranks ({num_ranks}) must all be >= 1"
        )
    stats = PackingStats()
    pieces: list[Piece] = []
    for sample_id, sample in enumerate(samples):
        piece, truncated = _fit(sample_id, sample, seq_len)
        if truncated:
            stats.truncated_sample_ids.append(sample_id)
        if piece is None:
            stats.dropped_sample_ids.append(sample_id)
            continue
        for packer in packers:
            extra = packer.fit(sample, piece, seq_len)
            if extra is not None:
                piece.extras[packer.name] = extra
        pieces.append(piece)

    rows = _first_fit_decreasing(pieces, seq_len)
    num_micro_batches = math.ceil(len(rows) / micro_batch_size)
    micro_batches_per_rank = max(1, math.ceil(num_micro_batches / num_ranks))
    rank_rows = _assign_to_ranks(rows, num_ranks, micro_batches_per_rank * micro_batch_size)
    for packer in packers:
        packer.begin(extras.get(packer.name, []), micro_batches_per_rank * num_ranks)

    rank_batches: list[list[MicroBatch]] = []
    for rows_of_rank in rank_rows:
        chunks = [
            rows_of_rank[i : i + micro_batch_size] for i in range(0, len(rows_of_rank), micro_batch_size)
        ]
        num_padding = micro_batches_per_rank - len(chunks)
        stats.num_padding_micro_batches += num_padding
        chunks += [[] for _ in range(num_padding)]
        rank_batches.append([_micro_batch(c, seq_len, pad_token_id, temperature, packers) for c in chunks])

    stats.num_rows = len(rows)
    if rows:
        stats.fill_ratio = sum(len(p.input_ids) for p in pieces) / (len(rows) * seq_len)
    for packer in packers:
        built = [g for mbs in rank_batches for mb in mbs if (g := mb.groups.get(packer.name)) is not None]
        stats.group_metrics.update(packer.metrics(samples, pieces, built))
    return rank_batches, stats

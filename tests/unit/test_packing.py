"""Packing: row layout worked out by hand, truncation/drop rules, equal micro-batch counts."""

from __future__ import annotations

import pytest
import torch

from prime_composer.orchestrator.packing import pack_step
from prime_composer.orchestrator.sample import Sample

PAD = 0


def make(
    num_prompt: int,
    num_completion: int,
    *,
    mask: list[int] | None = None,
    advantage: float = 1.0,
    tag: int = 1,
) -> Sample:
    """Prompt tokens are 100+tag, completion tokens 200+tag, logprobs -(1 + position) / 10."""
    return Sample(
        prompt_ids=[100 + tag] * num_prompt,
        completion_ids=[200 + tag] * num_completion,
        completion_logprobs=[-(i + 1) / 10 for i in range(num_completion)],
        completion_mask=[1] * num_completion if mask is None else mask,
        reward=0.0,
        example_id=tag,
        group_id=tag,
        policy_step=0,
        advantage=advantage,
    )


def test_first_fit_decreasing_layout() -> None:
    # lengths 6, 5, 4, 3, 2 into rows of 10: 6+4 | 5+3+2
    samples = [make(3, 3, tag=0), make(2, 3, tag=1), make(2, 2, tag=2), make(1, 2, tag=3), make(1, 1, tag=4)]
    # sample lengths:        6              5              4              3              2
    rank_batches, stats = pack_step(samples, seq_len=10, micro_batch_size=2, num_ranks=1, pad_token_id=PAD)
    assert len(rank_batches) == 1 and len(rank_batches[0]) == 1
    mb = rank_batches[0][0]
    assert mb.sample_ids.tolist() == [[0] * 6 + [2] * 4, [1] * 5 + [3] * 3 + [4] * 2]
    assert mb.position_ids.tolist() == [
        [0, 1, 2, 3, 4, 5, 0, 1, 2, 3],
        [0, 1, 2, 3, 4, 0, 1, 2, 0, 1],
    ]
    assert (stats.num_rows, stats.fill_ratio) == (2, 1.0)


def test_token_values_mask_and_padding() -> None:
    # completion: policy, tool (mask 0), policy
    sample = make(2, 3, mask=[1, 0, 1], advantage=-0.5, tag=7)
    (micro_batches,), _ = pack_step([sample], seq_len=8, micro_batch_size=1, num_ranks=1, pad_token_id=PAD)
    mb = micro_batches[0]
    assert mb.input_ids.tolist() == [[107, 107, 207, 207, 207, PAD, PAD, PAD]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert mb.loss_mask.tolist() == [[False, False, True, False, True, False, False, False]]
    assert mb.advantages.tolist() == [[0, 0, -0.5, 0, -0.5, 0, 0, 0]]
    assert mb.inference_logprobs[0].tolist() == pytest.approx([0, 0, -0.1, -0.2, -0.3, 0, 0, 0])
    assert mb.sample_ids.tolist() == [[0, 0, 0, 0, 0, -1, -1, -1]]
    assert mb.groups == {}  # no group packer: no term-specific tensors


def test_truncation_cuts_completion_end() -> None:
    # prompt 4 + completion 8 into seq_len 10: the last 2 completion tokens go
    (micro_batches,), stats = pack_step(
        [make(4, 8)], seq_len=10, micro_batch_size=1, num_ranks=1, pad_token_id=PAD
    )
    mb = micro_batches[0]
    assert stats.truncated_sample_ids == [0] and stats.dropped_sample_ids == []
    assert mb.loss_mask.sum().item() == 6
    assert mb.inference_logprobs[0, 4:].tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5, -0.6])
    assert mb.input_ids[0].tolist() == [101] * 4 + [201] * 6


def test_drops_samples_with_nothing_to_train() -> None:
    samples = [
        make(10, 2, tag=0),  # prompt fills seq_len
        make(2, 3, mask=[0, 0, 0], tag=1),  # no policy token
        make(3, 9, mask=[0] * 7 + [1, 1], tag=2),  # policy tokens only in the truncated tail
        make(2, 2, tag=3),  # kept
    ]
    rank_batches, stats = pack_step(samples, seq_len=10, micro_batch_size=1, num_ranks=1, pad_token_id=PAD)
    assert stats.dropped_sample_ids == [0, 1, 2]
    assert stats.truncated_sample_ids == [0, 2]
    (mb,) = rank_batches[0]
    assert set(mb.sample_ids.unique().tolist()) == {-1, 3}
    assert int(mb.loss_mask.sum()) == 2


def test_every_rank_gets_the_same_number_of_micro_batches() -> None:
    # three full rows, two ranks, one row per micro-batch: 2 + 1 real, one padding micro-batch
    samples = [make(2, 4, tag=i) for i in range(3)]
    rank_batches, stats = pack_step(samples, seq_len=6, micro_batch_size=1, num_ranks=2, pad_token_id=PAD)
    assert [len(r) for r in rank_batches] == [2, 2]
    assert stats.num_padding_micro_batches == 1
    padding = rank_batches[1][1]
    assert padding.num_rows == 1
    assert (padding.sample_ids == -1).all() and not padding.loss_mask.any()
    assert (padding.input_ids == PAD).all()
    assert padding.position_ids.tolist() == [list(range(6))]  # one padding "sample"


def test_no_samples_still_gives_each_rank_a_micro_batch() -> None:
    rank_batches, stats = pack_step([], seq_len=8, micro_batch_size=2, num_ranks=3, pad_token_id=PAD)
    assert [len(r) for r in rank_batches] == [1, 1, 1]
    assert all(not r[0].loss_mask.any() and (r[0].sample_ids == -1).all() for r in rank_batches)
    assert stats.num_rows == 0


def test_ranks_are_balanced_by_tokens() -> None:
    # rows of 10, 9, 8, 7 tokens over 2 ranks: 10 -> r0, 9 -> r1, 8 -> r1 (17), 7 -> r0 (17)
    # (filling rank 0 first would give 19 and 15)
    samples = [make(5, 5, tag=0), make(4, 5, tag=1), make(4, 4, tag=2), make(3, 4, tag=3)]
    rank_batches, _ = pack_step(samples, seq_len=10, micro_batch_size=1, num_ranks=2, pad_token_id=PAD)
    tokens = [sum((mb.sample_ids >= 0).sum().item() for mb in r) for r in rank_batches]
    assert tokens == [17, 17]


def _packed_tokens(rank_batches: list) -> dict[int, tuple]:
    """Per sample: its (input_ids, loss_mask, advantages, logprobs) wherever it was packed."""
    out = {}
    for micro_batches in rank_batches:
        for mb in micro_batches:
            for sid in mb.sample_ids.unique().tolist():
                if sid >= 0:
                    sel = mb.sample_ids == sid
                    out[sid] = tuple(
                        t[sel].tolist()
                        for t in (mb.input_ids, mb.loss_mask, mb.advantages, mb.inference_logprobs)
                    )
    return out


def test_one_rank_by_four_equals_two_ranks_by_two() -> None:
    # 8 samples of 5 tokens (2 prompt + 3 completion) in rows of 10: 4 full rows
    samples = [make(2, 3, advantage=float(i), tag=i) for i in range(8)]
    one, _ = pack_step(samples, seq_len=10, micro_batch_size=1, num_ranks=1, pad_token_id=PAD)
    two, _ = pack_step(samples, seq_len=10, micro_batch_size=1, num_ranks=2, pad_token_id=PAD)
    assert [len(r) for r in one] == [4] and [len(r) for r in two] == [2, 2]
    for split in (one, two):
        assert sum(int(mb.loss_mask.sum()) for r in split for mb in r) == 24
    assert _packed_tokens(one) == _packed_tokens(two)
    assert sorted(_packed_tokens(one)) == list(range(8))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="micro_batch_size"):
        pack_step([make(1, 1)], seq_len=8, micro_batch_size=0, num_ranks=1, pad_token_id=PAD)


def test_tensor_dtypes() -> None:
    (micro_batches,), _ = pack_step(
        [make(2, 2)], seq_len=8, micro_batch_size=1, num_ranks=1, pad_token_id=PAD
    )
    mb = micro_batches[0]
    assert mb.loss_mask.dtype == torch.bool and mb.advantages.dtype == torch.float32

"""SDPO in packed micro-batches: student targets and teacher rows line up token for token."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from prime_composer.orchestrator.packing import pack_step
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.sdpo.packing import SDPOPacker
from prime_composer.orchestrator.sdpo.target import sdpo_target, set_sdpo_target
from prime_composer.transport.batch import BatchFormatError, MicroBatch, decode_rank_batch, encode_rank_batch
from prime_composer.transport.groups import SDPOGroup

PAD = 0


def _sample(rng: random.Random, i: int, hinted: bool, seq_len: int) -> Sample:
    prompt = [rng.randint(1, 99) for _ in range(rng.randint(2, 6))]
    # Two turns: policy tokens, 2 spliced environment tokens (mask 0), policy tokens.
    first, second = rng.randint(1, 4), rng.randint(1, 4)
    completion = [rng.randint(100, 199) for _ in range(first + 2 + second)]
    mask = [1] * first + [0, 0] + [1] * second
    s = Sample(
        prompt_ids=prompt,
        completion_ids=completion,
        completion_logprobs=[-0.5] * len(completion),
        completion_mask=mask,
        reward=0.0,
        example_id=i,
        group_id=i,
        policy_step=0,
        advantage=1.0,
    )
    if hinted:
        span = (first + 2, first + 2 + second) if i % 2 else (0, first)
        hint = [rng.randint(200, 299) for _ in range(rng.randint(1, 5))]
        prefix = prompt + completion[: span[0]] + hint  # the hint goes right before the target turn
        set_sdpo_target(s, span, prefix[: seq_len - (span[1] - span[0])])
    return s


def pack(samples: list[Sample], seq_len: int, micro_batch_size: int, num_ranks: int = 1):
    return pack_step(samples, seq_len, micro_batch_size, num_ranks, PAD, packers=[SDPOPacker()])


def _row_major(values: torch.Tensor, mask: torch.Tensor) -> list[int]:
    return values[mask].tolist()  # boolean indexing walks rows in order, left to right


def test_teacher_rows_align_with_student_targets():
    rng = random.Random(0)
    seq_len = 24
    samples = [_sample(rng, i, hinted=i % 3 != 0, seq_len=seq_len) for i in range(14)]
    rank_batches, stats = pack(samples, seq_len, micro_batch_size=2, num_ranks=2)
    expected_total = sum(sdpo_target(s).span[1] - sdpo_target(s).span[0] for s in samples if sdpo_target(s))
    seen_hinted: set[int] = set()
    total = 0
    for mbs in rank_batches:
        for mb in mbs:
            group = mb.group(SDPOGroup)
            if group is None:
                continue
            total += group.num_tokens
            assert not (group.student_mask & ~mb.loss_mask).any()  # targets are policy tokens only
            assert _row_major(mb.input_ids, group.student_mask) == _row_major(
                group.teacher_input_ids, group.teacher_target_mask
            )
            # Every hinted student here has its whole teacher sequence in this micro-batch's teacher rows.
            teacher_seqs = []
            for r in range(group.teacher_input_ids.shape[0]):
                starts = [*(group.teacher_position_ids[r] == 0).nonzero().flatten().tolist(), seq_len]
                for a, b in itertools.pairwise(starts):
                    if group.teacher_target_mask[r, a:b].any():
                        teacher_seqs.append(group.teacher_input_ids[r, a:b].tolist())
            hinted_here = [int(i) for i in torch.unique(mb.sample_ids[group.student_mask]).tolist()]
            seen_hinted.update(hinted_here)
            expected_seqs = sorted(
                sdpo_target(samples[i]).teacher_prefix_ids
                + samples[i].completion_ids[slice(*sdpo_target(samples[i]).span)]
                for i in hinted_here
            )
            assert sorted(teacher_seqs) == expected_seqs
    assert total == expected_total
    assert seen_hinted == {i for i, s in enumerate(samples) if sdpo_target(s)}
    metrics = stats.metrics()
    assert metrics["sdpo/packed_samples"] == len(seen_hinted) and metrics["sdpo/teacher_rows"] > 0
    assert metrics["sdpo/pack_dropped"] == 0


def test_positions_restart_for_every_teacher_sequence():
    rng = random.Random(1)
    samples = [_sample(rng, i, hinted=True, seq_len=40) for i in range(6)]
    (mbs,), _ = pack(samples, 40, micro_batch_size=8)
    (mb,) = mbs
    group = mb.group(SDPOGroup)
    assert group is not None
    for r in range(group.teacher_input_ids.shape[0]):
        pos = group.teacher_position_ids[r].tolist()
        # Contiguous runs 0, 1, 2, ...: every step is +1 or a restart at 0.
        assert pos[0] == 0 and all(b == a + 1 or b == 0 for a, b in itertools.pairwise(pos))


def _assert_same(a: MicroBatch, b: MicroBatch) -> None:
    assert a.temperature == b.temperature and a.groups.keys() == b.groups.keys()
    pairs = [(a.core_tensors(), b.core_tensors())]
    pairs += [(a.groups[k].tensors(), b.groups[k].tensors()) for k in a.groups]
    for x, y in pairs:
        assert x.keys() == y.keys()
        for name, tensor in x.items():
            assert torch.equal(tensor, y[name]) and tensor.dtype == y[name].dtype, name


def test_no_hint_gives_no_group_and_both_round_trip():
    rng = random.Random(2)
    plain = [_sample(rng, i, hinted=False, seq_len=30) for i in range(3)]
    (mbs,), stats = pack(plain, 30, micro_batch_size=4)
    assert mbs[0].group(SDPOGroup) is None and mbs[0].groups == {}
    assert stats.metrics()["sdpo/teacher_rows"] == 0
    hinted = [_sample(rng, i, hinted=True, seq_len=30) for i in range(3)]
    (hinted_mbs,), _ = pack(hinted, 30, micro_batch_size=1)
    assert all(mb.group(SDPOGroup) is not None for mb in hinted_mbs)
    for batch in (mbs, hinted_mbs):
        _, _, decoded = decode_rank_batch(encode_rank_batch(3, 0, batch))
        for a, b in zip(batch, decoded, strict=True):
            _assert_same(a, b)


def test_student_truncation_clips_the_span_and_a_teacher_too_long_drops_sdpo():
    s = Sample(
        prompt_ids=[1, 2, 3],
        completion_ids=[10, 11, 12, 13, 14],
        completion_logprobs=[0.0] * 5,
        completion_mask=[1] * 5,
        reward=0.0,
        example_id=0,
        group_id=0,
        policy_step=0,
    )
    set_sdpo_target(s, (0, 5), [1, 2, 50])  # a teacher context cut in the middle, say
    (mbs,), stats = pack([s], 6, micro_batch_size=1)
    (mb,) = mbs
    group = mb.group(SDPOGroup)
    assert group is not None
    # Student keeps 3 prompt + 3 completion tokens; the span is cut to those 3.
    assert group.student_mask[0].tolist() == [False] * 3 + [True] * 3
    assert group.teacher_input_ids[0].tolist() == [1, 2, 50, 10, 11, 12]
    assert group.teacher_target_mask[0].tolist() == [False] * 3 + [True] * 3
    assert group.num_tokens == 3 and stats.metrics()["sdpo/pack_dropped"] == 0
    set_sdpo_target(s, (0, 3), [1, 2, 3, 50, 51, 52, 53])  # 7 + 3 > 10
    (mbs,), stats = pack([s], 8, micro_batch_size=1)
    assert stats.metrics()["sdpo/pack_dropped"] == 1 and mbs[0].group(SDPOGroup) is None


def test_micro_batch_rejects_misaligned_sdpo_masks():
    rng = random.Random(3)
    (mbs,), _ = pack([_sample(rng, 1, hinted=True, seq_len=30)], 30, 1)
    mb = mbs[0]
    group = mb.group(SDPOGroup)
    assert group is not None
    bad = group.teacher_target_mask.clone()
    bad[0, 0] = True
    with pytest.raises(BatchFormatError, match="align one to one"):
        MicroBatch(
            **mb.core_tensors(),
            groups={"sdpo": SDPOGroup(**{**group.tensors(), "teacher_target_mask": bad})},
        )
    outside = group.student_mask.clone()
    outside[~mb.loss_mask] = False
    outside[0, 0] = True  # a prompt token
    with pytest.raises(BatchFormatError, match="outside loss_mask"):
        MicroBatch(
            **mb.core_tensors(), groups={"sdpo": SDPOGroup(**{**group.tensors(), "student_mask": outside})}
        )

"""The SDPO term's teacher forward skips the padding of short teacher rows, with the same logits."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from prime_composer.config.loss import SDPOLossConfig
from prime_composer.trainer.losses.sdpo_term import SDPOTerm
from prime_composer.trainer.policy_copy import PolicyCopy


def _model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
    )  # fmt: skip
    model = Qwen3ForCausalLM(config).double()
    model.config._attn_implementation = "sdpa"
    return model


def _rows(fills: list[list[tuple[int, int]]], width: int) -> tuple[torch.Tensor, ...]:
    """Packed teacher rows: each row a list of (sequence length, target length), then padding."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.zeros((len(fills), width), dtype=torch.long)
    positions = torch.zeros_like(ids)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for r, row in enumerate(fills):
        start = 0
        for length, targets in row:
            ids[r, start : start + length] = torch.randint(3, 97, (length,), generator=gen)
            positions[r, start : start + length] = torch.arange(length)
            mask[r, start + length - targets : start + length] = True
            start += length
        positions[r, start:] = torch.arange(width - start)
    return ids, positions, mask


def test_trimmed_teacher_forward_gives_the_untrimmed_logits_with_fewer_tokens() -> None:
    model = _model()
    teacher = PolicyCopy(model, "frozen")
    term = SDPOTerm(SDPOLossConfig(weight=0.1, teacher="frozen"), teacher)
    # Full row, a short row in the middle, a full row, a short last row (next-fit leaves such gaps).
    ids, positions, mask = _rows([[(30, 10), (34, 12)], [(20, 5)], [(64, 20)], [(12, 4), (9, 3)]], 64)
    expected = teacher.target_logits(ids, positions, mask, 0.7)  # one forward over every column

    seen: list[tuple[int, ...]] = []
    handle = teacher.module.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    try:
        got = term._target_logits(ids, positions, mask, 0.7)
    finally:
        handle.remove()
    assert got.shape == expected.shape == (int(mask.sum()), 97)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    # The two full rows at 64 columns, the two short ones at 21 (the longest short content).
    assert seen == [(2, 64), (2, 21)]


def test_rows_of_similar_fill_take_one_forward_trimmed_to_the_longest() -> None:
    model = _model()
    teacher = PolicyCopy(model, "frozen")
    term = SDPOTerm(SDPOLossConfig(weight=0.1, teacher="frozen"), teacher)
    ids, positions, mask = _rows([[(40, 10)], [(30, 8)]], 64)
    before = teacher.num_forwards
    got = term._target_logits(ids, positions, mask, 1.0)
    assert teacher.num_forwards == before + 1
    torch.testing.assert_close(got, teacher.target_logits(ids, positions, mask, 1.0), rtol=0, atol=1e-12)

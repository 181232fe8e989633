"""The grouped-query SDPA used by the server (inference/hf/attention.py) against transformers' own sdpa."""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from prime_composer.inference.hf.attention import gqa_sdpa_forward


class _Module(torch.nn.Module):
    """The attributes transformers' attention functions read from the attention module."""

    def __init__(self, num_groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = num_groups
        self.is_causal = True


def test_matches_transformers_sdpa_with_padding_mask():
    gen = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, q_len, kv_len, dim = 3, 6, 2, 4, 9, 16
    query = torch.randn(batch, heads, q_len, dim, generator=gen)
    key = torch.randn(batch, kv_heads, kv_len, dim, generator=gen)
    value = torch.randn(batch, kv_heads, kv_len, dim, generator=gen)
    mask = torch.ones(batch, 1, q_len, kv_len, dtype=torch.bool).tril(diagonal=kv_len - q_len)
    mask[1, :, :, :3] = False  # a left-padded row
    module = _Module(heads // kv_heads)

    ours, _ = gqa_sdpa_forward(module, query, key, value, mask, scaling=0.25)
    reference, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    assert ours.shape == (batch, q_len, heads, dim)
    assert (ours - reference).abs().max().item() < 1e-5


def test_hands_special_cases_to_transformers():
    module = _Module(1)
    query = key = value = torch.randn(1, 2, 3, 8)
    # no mask: transformers' own path (causal), not a silent unmasked attention
    ours, _ = gqa_sdpa_forward(module, query, key, value, None)
    reference, _ = sdpa_attention_forward(module, query, key, value, None)
    assert torch.equal(ours, reference)

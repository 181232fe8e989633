"""The prepacked output layer (inference/hf/output_head.py): same logits as the model, used only then.

References are independent: a float64 matrix product of the hidden states with the output
layer's weight, and the Hugging Face model's own forward.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from prime_composer.inference.hf.output_head import packed_output_head
from prime_composer.model.resolve import resolve_model_name


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    path = resolve_model_name("builtin:tiny-qwen3")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


class _ScaledLogits(torch.nn.Module):
    """A model whose forward scales the logits after the output layer (like logit soft-capping)."""

    def __init__(self, inner: torch.nn.Module, scale: float) -> None:
        super().__init__()
        self.inner, self.scale = inner, scale

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.inner.get_output_embeddings()

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.inner.get_input_embeddings()

    def get_decoder(self) -> torch.nn.Module:
        return self.inner.get_decoder()

    def forward(self, **kwargs):
        out = self.inner(**kwargs)
        out.logits = out.logits * self.scale
        return out


def test_logits_match_a_float64_product_and_follow_weight_changes(tiny):
    head = packed_output_head(tiny)
    assert head is not None  # float32 on CPU, plain forward: the packed path is taken
    weight = tiny.get_output_embeddings().weight
    hidden = torch.randn(5, weight.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = hidden.double() @ weight.double().T
        assert (head(hidden).double() - expected).abs().max().item() < 1e-4
        weight.mul_(2.0)  # an in-place update, as a weight swap does, and nobody calls refresh
        try:
            assert (head(hidden).double() - 2 * expected).abs().max().item() < 1e-4  # repacked
            head.refresh()
            assert (head(hidden).double() - 2 * expected).abs().max().item() < 1e-4
        finally:
            weight.div_(2.0)
        assert (head(hidden).double() - expected).abs().max().item() < 1e-4


def test_models_whose_logits_differ_keep_their_own_forward(tiny):
    assert packed_output_head(_ScaledLogits(tiny, 1.0)) is not None
    assert packed_output_head(_ScaledLogits(tiny, 0.5)) is None
    bf16 = _ScaledLogits(tiny, 1.0)
    bf16.inner = type(tiny)(tiny.config).to(torch.bfloat16).eval()
    assert packed_output_head(bf16) is None

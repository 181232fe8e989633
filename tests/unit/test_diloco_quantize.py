"""Blockwise absmax quantization: per-block error bounds, exact codes, packing."""

from __future__ import annotations

import pytest
import torch

from prime_composer.diloco.quantize import dequantize, expected_sizes, quantize


@pytest.mark.parametrize(("kind", "levels"), [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("numel", [1, 63, 64, 1000])
def test_error_is_within_half_a_level_of_each_block(kind: str, levels: int, numel: int) -> None:
    block = 64
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * torch.logspace(-6, 0, numel)
    y = dequantize(quantize(x, kind, block))  # type: ignore[arg-type]
    assert y.shape == x.shape
    for start in range(0, numel, block):
        xb, yb = x[start : start + block], y[start : start + block]
        bound = xb.abs().max() / (2 * levels)
        assert (xb - yb).abs().max() <= bound * (1 + 1e-5) + 1e-12


def test_codes_match_a_hand_computation() -> None:
    # One block, absmax 1.4: int4 levels are multiples of 0.2. round(x / 0.2) by hand:
    x = torch.tensor([1.4, -0.7, 0.29, 0.0, -1.4, 0.11])
    y = dequantize(quantize(x, "int4", 6))
    expected = torch.tensor([7, -4, 1, 0, -7, 1]) * 0.2  # -3.5 rounds to even (-4), 0.55 to 1
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-6)


def test_zero_block_and_full_precision_round_trip() -> None:
    assert torch.equal(dequantize(quantize(torch.zeros(10), "int8", 4)), torch.zeros(10))
    x = torch.randn(33)
    assert torch.equal(dequantize(quantize(x, "none", 4)), x)


@pytest.mark.parametrize(("kind", "bytes_per_value"), [("int8", 1.0), ("int4", 0.5), ("none", 4.0)])
def test_payload_sizes(kind: str, bytes_per_value: float) -> None:
    q = quantize(torch.randn(1024), kind, 128)  # type: ignore[arg-type]
    num_code_bytes, num_scales = expected_sizes(kind, 1024, 128)  # type: ignore[arg-type]
    assert q.codes.numel() == num_code_bytes == int(1024 * bytes_per_value)
    assert q.scales.numel() == num_scales == (0 if kind == "none" else 8)

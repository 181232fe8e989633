"""Blockwise absmax quantization of pseudo-gradients (int8, int4) and its exact inverse.

A flat float32 vector is cut into blocks of ``block_size`` values (the last one zero-padded).
Each block gets one float32 scale ``s = max |x|`` and every value becomes an integer code

    q = round(x / s * L),   L = 127 (int8) or 7 (int4),   q in [-L, L]

so the dequantized value ``q * s / L`` is within ``s / (2 L)`` of ``x``: half a level of that
block. int4 codes are stored as ``q + 8`` (1..15), two per byte (low nibble first).

Why blockwise absmax rather than torchft's FP8: it runs anywhere (no Triton), its error bound is
per block and known, and 4 bits is what Streaming DiLoCo showed to be enough for outer gradients.
The arithmetic is plain IEEE float32 on CPU, so every DC dequantizes a payload to the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prime_composer.config.diloco import Quantization

LEVELS: dict[str, int] = {"int8": 127, "int4": 7}
"""Largest code magnitude per quantization kind."""


@dataclass(frozen=True)
class Quantized:
    """A quantized flat vector: ``codes`` (uint8, packed for int4) and one scale per block."""

    kind: Quantization
    numel: int
    block_size: int
    codes: torch.Tensor
    """uint8: one code + 128 per value (int8), two codes + 8 per byte (int4), or for ``none`` the
    float32 values viewed as bytes."""
    scales: torch.Tensor
    """float32 ``[num_blocks]`` (empty for ``none``)."""

    @property
    def num_bytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * 4


def quantize(x: torch.Tensor, kind: Quantization, block_size: int) -> Quantized:
    """Quantize a flat float32 CPU tensor (see the module docstring for the format)."""
    assert x.dim() == 1 and x.dtype == torch.float32, (x.shape, x.dtype)
    numel = x.numel()
    if kind == "none":
        return Quantized(
            kind,
            numel,
            block_size,
            x.contiguous().view(torch.uint8).clone(),
            torch.empty(0, dtype=torch.float32),
        )
    levels = LEVELS[kind]
    num_blocks = max(1, -(-numel // block_size))
    padded = torch.zeros(num_blocks * block_size, dtype=torch.float32)
    padded[:numel] = x
    blocks = padded.view(num_blocks, block_size)
    scales = blocks.abs().amax(dim=1)
    # A block of zeros has scale 0: divide by 1 instead (its codes are 0 either way).
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, None] * levels).clamp_(-levels, levels).to(torch.int16)
    if kind == "int8":
        codes = (q + 128).to(torch.uint8).view(-1)
    else:
        nibbles = (q + 8).to(torch.uint8).view(-1, 2)
        codes = nibbles[:, 0] | (nibbles[:, 1] << 4)
    return Quantized(kind, numel, block_size, codes.contiguous(), scales.contiguous())


def dequantize(q: Quantized) -> torch.Tensor:
    """The float32 vector ``q`` stands for (``numel`` values)."""
    if q.kind == "none":
        return q.codes.view(torch.float32)[: q.numel].clone()
    levels = LEVELS[q.kind]
    if q.kind == "int8":
        values = q.codes.to(torch.int16) - 128
    else:
        low = (q.codes & 0x0F).to(torch.int16) - 8
        high = (q.codes >> 4).to(torch.int16) - 8
        values = torch.stack([low, high], dim=1).view(-1)
    blocks = values.to(torch.float32).view(-1, q.block_size)
    step = q.scales / levels
    return (blocks * step[:, None]).view(-1)[: q.numel].contiguous()


def expected_sizes(kind: Quantization, numel: int, block_size: int) -> tuple[int, int]:
    """``(num_code_bytes, num_scales)`` a valid payload of ``numel`` values must have."""
    if kind == "none":
        return numel * 4, 0
    num_blocks = max(1, -(-numel // block_size))
    padded = num_blocks * block_size
    return (padded if kind == "int8" else padded // 2), num_blocks

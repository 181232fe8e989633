"""The signed payloads DCs exchange: pseudo-gradients, round commits and fragment states.

Wire format (one file, served by a DC's shardcast origin)::

    b"PCDILOCO1\\n" | header length (8 bytes, big endian) | header (JSON) | body | tag (32 bytes)

``tag = HMAC-SHA256(secret, everything before it)``; a payload made without a secret carries 32
zero bytes and is rejected as ``unsigned`` by any DC that has one. The header names the run, the
sender, the kind (``grad`` | ``commit`` | ``state``), the round and fragment, and ``body_sha256``.
A reader checks, in this order, that the frame is well formed, the tag, the body digest, and then
that run id, sender, kind, round and fragment are the ones it asked for, so a tampered payload, an
unsigned one, and an old payload served again for a newer round (a replay) are all rejected,
each with its own reason (``PayloadError.reason``, counted in the metrics).

Bodies: ``grad`` holds the quantized codes then the float32 scales (zlib-compressed when the
header says so); ``state`` holds the global weights then the outer momentum of one fragment
(float32); ``commit`` has no body (its header lists the agreed members).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Literal

import torch

from prime_composer.diloco.quantize import Quantized, expected_sizes

MAGIC = b"PCDILOCO1\n"
TAG_BYTES = 32
_UNSIGNED = bytes(TAG_BYTES)
MAX_HEADER_BYTES = 1 << 20

Kind = Literal["grad", "commit", "state"]


class PayloadError(ValueError):
    """A payload that must not be used; ``reason`` is a short metric name."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


def encode(header: dict[str, Any], body: bytes, secret: bytes | None) -> bytes:
    """Frame and sign a payload (``body_sha256`` and ``body_bytes`` are added to the header)."""
    header = {**header, "body_sha256": hashlib.sha256(body).hexdigest(), "body_bytes": len(body)}
    raw = json.dumps(header, sort_keys=True).encode()
    framed = MAGIC + struct.pack(">Q", len(raw)) + raw + body
    tag = hmac.new(secret, framed, hashlib.sha256).digest() if secret else _UNSIGNED
    return framed + tag


def decode(data: bytes, secret: bytes | None, expect: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """``(header, body)`` of a payload that passes every check, else ``PayloadError``.

    ``expect`` holds header fields that must have exactly these values (run id, sender, kind,
    round, fragment, ...). Without a secret (a single-DC run) the tag is not checked.
    """
    prefix = len(MAGIC) + 8
    if len(data) < prefix + TAG_BYTES or not data.startswith(MAGIC):
        raise PayloadError("malformed", f"not a DiLoCo payload ({len(data)} bytes)")
    (header_len,) = struct.unpack(">Q", data[len(MAGIC) : prefix])
    if header_len > MAX_HEADER_BYTES or prefix + header_len + TAG_BYTES > len(data):
        raise PayloadError("malformed", f"header length {header_len} does not fit the payload")
    framed, tag = data[:-TAG_BYTES], data[-TAG_BYTES:]
    if secret:
        if tag == _UNSIGNED:
            raise PayloadError("unsigned", "the payload carries no signature")
        if not hmac.compare_digest(tag, hmac.new(secret, framed, hashlib.sha256).digest()):
            raise PayloadError("bad_signature", "signature does not match (tampered, or another secret)")
    try:
        header = json.loads(framed[prefix : prefix + header_len])
        assert isinstance(header, dict)
    except (ValueError, AssertionError):
        raise PayloadError("malformed", "header is not a JSON object") from None
    body = framed[prefix + header_len :]
    if len(body) != header.get("body_bytes") or hashlib.sha256(body).hexdigest() != header.get("body_sha256"):
        raise PayloadError("checksum", "body does not match the digest in its header")
    for key, value in expect.items():
        if header.get(key) != value:
            reason = "replayed" if key == "round" else f"wrong_{key}"
            raise PayloadError(reason, f"header {key} = {header.get(key)!r}, expected {value!r}")
    return header, body


# ---------------------------------------------------------------------------------- grad bodies


def grad_body(q: Quantized, compression: str) -> tuple[dict[str, Any], bytes]:
    """Header fields and body of a quantized pseudo-gradient."""
    body = q.codes.numpy().tobytes() + q.scales.numpy().tobytes()
    if compression == "zlib":
        body = zlib.compress(body, level=1)
    fields = {
        "quantization": q.kind,
        "block_size": q.block_size,
        "numel": q.numel,
        "compression": compression,
    }
    return fields, body


@dataclass(frozen=True)
class GradPayload:
    cluster: str
    num_tokens: int
    base_digest: str
    quantized: Quantized
    digest: str
    """SHA-256 of the whole payload (what a commit names)."""


def parse_grad(header: dict[str, Any], body: bytes, digest: str) -> GradPayload:
    """The quantized pseudo-gradient in a verified ``grad`` payload (sizes checked)."""
    kind, numel, block = header["quantization"], int(header["numel"]), int(header["block_size"])
    if header.get("compression") == "zlib":
        try:
            body = zlib.decompress(body)
        except zlib.error:
            raise PayloadError("malformed", "body does not decompress") from None
    num_code_bytes, num_scales = expected_sizes(kind, numel, block)
    if len(body) != num_code_bytes + 4 * num_scales:
        raise PayloadError("malformed", f"body holds {len(body)} bytes, {kind} x {numel} needs more/less")
    codes = torch.frombuffer(bytearray(body[:num_code_bytes]), dtype=torch.uint8)
    if num_scales == 0:
        scales = torch.empty(0, dtype=torch.float32)
    else:
        scales = torch.frombuffer(bytearray(body[num_code_bytes:]), dtype=torch.float32)
    if not bool(torch.isfinite(scales).all()):
        raise PayloadError("malformed", "non-finite quantization scale")
    q = Quantized(kind, numel, block, codes, scales)
    return GradPayload(header["cluster"], int(header["num_tokens"]), header["base_digest"], q, digest)


def tensor_digest(x: torch.Tensor) -> str:
    """SHA-256 of a float32 CPU tensor's bytes (global-weight digests compared across DCs)."""
    return hashlib.sha256(x.contiguous().numpy().tobytes()).hexdigest()


def state_body(theta: torch.Tensor, momentum: torch.Tensor) -> bytes:
    return theta.numpy().tobytes() + momentum.numpy().tobytes()


def parse_state(body: bytes, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    if len(body) != 8 * numel:
        raise PayloadError("malformed", f"state body holds {len(body)} bytes, expected {8 * numel}")
    flat = torch.frombuffer(bytearray(body), dtype=torch.float32)
    return flat[:numel].clone(), flat[numel:].clone()

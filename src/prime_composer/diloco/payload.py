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
import re
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Literal

import torch

from prime_composer.config.diloco import Quantization
from prime_composer.diloco.quantize import Quantized, dequantize, expected_sizes

MAGIC = b"PCDILOCO1\n"
TAG_BYTES = 32
_UNSIGNED = bytes(TAG_BYTES)
MAX_HEADER_BYTES = 64 << 10
"""Largest header any payload may have (a commit of 200 DCs is ~50 KB)."""
_PREFIX = len(MAGIC) + 8

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


def max_payload_bytes(
    kind: Kind,
    numel: int,
    quantization: Quantization = "none",
    block_size: int = 2,
    compression: str = "none",
) -> int:
    """The most bytes a valid ``kind`` payload of a fragment of ``numel`` values can have: the
    frame, a header of at most ``MAX_HEADER_BYTES`` and the body (``grad``: the quantized codes and
    scales, plus zlib's worst-case growth when compressed; ``state``: two float32 vectors;
    ``commit``: none). Downloads are capped at it and ``decode`` rejects anything larger."""
    if kind == "grad":
        num_code_bytes, num_scales = expected_sizes(quantization, numel, block_size)
        body = num_code_bytes + 4 * num_scales
        if compression == "zlib":  # zlib's compressBound()
            body += (body >> 12) + (body >> 14) + (body >> 25) + 13
    else:
        body = 8 * numel if kind == "state" else 0
    return _PREFIX + MAX_HEADER_BYTES + body + TAG_BYTES


def decode(
    data: bytes, secret: bytes | None, expect: dict[str, Any], max_bytes: int | None = None
) -> tuple[dict[str, Any], bytes]:
    """``(header, body)`` of a payload that passes every check, else ``PayloadError``.

    ``expect`` holds header fields that must have exactly these values (run id, sender, kind,
    round, fragment, ...). Without a secret (a single-DC run) the tag is not checked. A payload
    over ``max_bytes`` (``max_payload_bytes``) or with a header over ``MAX_HEADER_BYTES`` is
    rejected as ``oversize`` before anything else is read.
    """
    prefix = _PREFIX
    if max_bytes is not None and len(data) > max_bytes:
        raise PayloadError(
            "oversize", f"{len(data)} bytes, more than the {max_bytes} such a payload can have"
        )
    if len(data) < prefix + TAG_BYTES or not data.startswith(MAGIC):
        raise PayloadError("malformed", f"not a DiLoCo payload ({len(data)} bytes)")
    (header_len,) = struct.unpack(">Q", data[len(MAGIC) : prefix])
    if header_len > MAX_HEADER_BYTES:
        raise PayloadError("oversize", f"header of {header_len} bytes, more than {MAX_HEADER_BYTES}")
    if prefix + header_len + TAG_BYTES > len(data):
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
    values: torch.Tensor
    """The dequantized pseudo-gradient (float32, every value finite)."""


def parse_grad(header: dict[str, Any], body: bytes, digest: str, max_num_tokens: int = 2**53) -> GradPayload:
    """The pseudo-gradient in a verified ``grad`` payload, if it is fit to be averaged.

    Rejected (``PayloadError``): a ``num_tokens`` that is not an integer in
    ``[0, max_num_tokens]`` (``bad_tokens``); a body that does not decompress to exactly the size
    of ``numel`` values (``malformed``, decompressed no further than that size); negative or
    non-finite scales, or codes outside ``[-L, L]`` (``malformed``); any non-finite value after
    dequantization, whatever the quantization (``non_finite``).
    """
    kind, numel, block = header["quantization"], int(header["numel"]), int(header["block_size"])
    num_tokens = header.get("num_tokens")
    if type(num_tokens) is not int or not 0 <= num_tokens <= max_num_tokens:
        raise PayloadError(
            "bad_tokens", f"num_tokens = {num_tokens!r}: an integer in [0, {max_num_tokens}] is needed"
        )
    num_code_bytes, num_scales = expected_sizes(kind, numel, block)
    size = num_code_bytes + 4 * num_scales
    if header.get("compression") == "zlib":
        inflate = zlib.decompressobj()
        try:
            raw = inflate.decompress(body, size + 1)
        except zlib.error:
            raise PayloadError("malformed", "body does not decompress") from None
        if len(raw) > size or inflate.unconsumed_tail or not inflate.eof:
            raise PayloadError(
                "malformed", f"body does not decompress to the {size} bytes of {kind} x {numel}"
            )
        body = raw
    if len(body) != size:
        raise PayloadError("malformed", f"body holds {len(body)} bytes, {kind} x {numel} needs {size}")
    codes = torch.frombuffer(bytearray(body[:num_code_bytes]), dtype=torch.uint8)
    if num_scales == 0:
        scales = torch.empty(0, dtype=torch.float32)
    else:
        scales = torch.frombuffer(bytearray(body[num_code_bytes:]), dtype=torch.float32)
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise PayloadError("malformed", "negative or non-finite quantization scale")
    # Code 0 stands for -128 (int8) or -8 (int4): one level past what quantize() writes.
    if kind == "int8" and bool((codes == 0).any()):
        raise PayloadError("malformed", "int8 code outside [-127, 127]")
    if kind == "int4" and bool(((codes & 0x0F) == 0).any() or ((codes >> 4) == 0).any()):
        raise PayloadError("malformed", "int4 code outside [-7, 7]")
    q = Quantized(kind, numel, block, codes, scales)
    values = dequantize(q)
    if not bool(torch.isfinite(values).all()):
        raise PayloadError("non_finite", "the pseudo-gradient holds NaN or infinite values")
    return GradPayload(header["cluster"], num_tokens, header["base_digest"], q, digest, values)


COMMIT_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def check_commit(header: dict[str, Any], cluster_ids: list[str], min_members: int = 1) -> None:
    """A verified ``commit`` header is well formed: ``members`` lists distinct DCs of the run as
    ``[cluster, sha256, num_tokens]``, ``next_candidates`` DCs of the run; else ``malformed``.
    A commit with members must have at least ``min_members`` (``diloco.min_clusters``), else
    ``too_few_members``: with ``min_clusters >= 2`` a coordinator cannot apply its own
    pseudo-gradient alone (a commit with none, no outer step, is allowed)."""
    members, candidates = header.get("members"), header.get("next_candidates")
    ok = isinstance(header.get("base_digest"), str) and isinstance(members, list)
    ok = ok and isinstance(candidates, list) and all(c in cluster_ids for c in candidates)
    if ok:
        assert isinstance(members, list)
        for m in members:
            ok = ok and isinstance(m, list) and len(m) == 3 and m[0] in cluster_ids
            ok = ok and isinstance(m[1], str) and bool(COMMIT_DIGEST.match(m[1])) and type(m[2]) is int
        ok = ok and len({m[0] for m in members}) == len(members)
    if not ok:
        raise PayloadError("malformed", "commit members or candidates are not DCs of this run")
    assert isinstance(members, list)
    if 0 < len(members) < min_members:
        raise PayloadError(
            "too_few_members", f"the commit has {len(members)} member(s), below min_clusters = {min_members}"
        )


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

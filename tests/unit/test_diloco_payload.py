"""Payload framing and verification: tampered, unsigned, replayed and foreign payloads fail."""

from __future__ import annotations

import pytest
import torch

from prime_composer.diloco.payload import PayloadError, decode, encode, grad_body, parse_grad
from prime_composer.diloco.quantize import dequantize, quantize

SECRET = b"shared"
HEADER = {"run_id": "r", "cluster": "dc-a", "kind": "grad", "round": 3, "fragment": 1}


def _payload(secret: bytes | None = SECRET, **overrides: object) -> bytes:
    fields, body = grad_body(quantize(torch.randn(100), "int4", 16), "zlib")
    return encode({**HEADER, **fields, "num_tokens": 7, "base_digest": "x", **overrides}, body, secret)


def test_round_trip() -> None:
    x = torch.randn(100)
    fields, body = grad_body(quantize(x, "int8", 16), "zlib")
    data = encode({**HEADER, **fields, "num_tokens": 7, "base_digest": "x"}, body, SECRET)
    header, body = decode(data, SECRET, HEADER)
    grad = parse_grad(header, body, digest="d")
    assert grad.num_tokens == 7 and grad.cluster == "dc-a"
    torch.testing.assert_close(
        dequantize(grad.quantized), dequantize(quantize(x, "int8", 16)), rtol=0, atol=0
    )


def test_every_single_byte_flip_is_rejected() -> None:
    data = _payload()
    for i in range(len(data)):
        tampered = bytearray(data)
        tampered[i] ^= 0x01
        with pytest.raises(PayloadError):
            decode(bytes(tampered), SECRET, HEADER)


@pytest.mark.parametrize(
    ("data", "expect", "reason"),
    [
        (_payload(secret=None), HEADER, "unsigned"),
        (_payload(secret=b"other"), HEADER, "bad_signature"),
        (_payload(), HEADER | {"round": 4}, "replayed"),
        (_payload(run_id="other-run"), HEADER, "wrong_run_id"),
        (_payload(cluster="dc-b"), HEADER, "wrong_cluster"),
        (b"garbage", HEADER, "malformed"),
    ],
)
def test_rejection_reasons(data: bytes, expect: dict[str, object], reason: str) -> None:
    with pytest.raises(PayloadError) as e:
        decode(data, SECRET, expect)
    assert e.value.reason == reason

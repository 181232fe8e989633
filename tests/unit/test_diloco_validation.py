"""Contributions are validated before they touch the global model.

Each hostile payload a key holder could send (a token count that dominates or extrapolates the
average, huge finite values, NaN and inf, an oversized body, a zlib bomb) is run through a real
round of the exchange between two honest DCs on an in-memory store; the global weights are
compared with a float64 reference computed here from the honest contributions alone (or with the
hostile one clipped by the documented rule), and the hostile payload must be fetched and counted
once per round. The rules themselves (weights, norm clipping, trimmed mean, size caps) are checked
against hand-computed numbers.
"""

from __future__ import annotations

import math
import statistics
import threading
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pydantic
import pytest
import torch

from prime_composer.config.diloco import DilocoConfig, OuterOptimConfig, ValidationConfig
from prime_composer.diloco.aggregate import aggregate, clip_factors, l2_norm, token_weights, trimmed_mean
from prime_composer.diloco.exchange import Exchange, RoundResult
from prime_composer.diloco.payload import (
    MAGIC,
    MAX_HEADER_BYTES,
    TAG_BYTES,
    PayloadError,
    check_commit,
    decode,
    encode,
    grad_body,
    max_payload_bytes,
    parse_grad,
    tensor_digest,
)
from prime_composer.diloco.quantize import quantize

SECRET = b"validation-secret"
NUMEL = 64
CLUSTERS = ["dc-a", "dc-b", "dc-z"]  # dc-z, the hostile one, sorts last: dc-a coordinates


# ------------------------------------------------------------------------------ a round in memory


class Board:
    """What every DC's origin serves, in one process."""

    def __init__(self) -> None:
        self.items: dict[tuple[str, str, int], bytes] = {}
        self.lock = threading.Lock()


class MemoryStore:
    """A ``Store`` over a ``Board`` that counts fetches and records the caps it is given; like a
    store that cannot tell a payload's size in advance, it returns oversized payloads whole."""

    def __init__(self, board: Board, me: str) -> None:
        self.board, self.me = board, me
        self.fetches: Counter[tuple[str, str, int]] = Counter()
        self.caps: dict[tuple[str, str, int], int | None] = {}

    def publish(self, kind: str, round_: int, data: bytes) -> None:
        with self.board.lock:
            self.board.items[(self.me, kind, round_)] = data

    def available(self, cluster: str, timeout_s: float) -> set[tuple[str, int]] | None:
        with self.board.lock:
            return {(k, r) for c, k, r in self.board.items if c == cluster}

    def fetch(
        self, cluster: str, kind: str, round_: int, timeout_s: float, max_bytes: int | None = None
    ) -> bytes | None:
        self.fetches[(cluster, kind, round_)] += 1
        self.caps[(cluster, kind, round_)] = max_bytes
        with self.board.lock:
            return self.board.items.get((cluster, kind, round_))

    def close(self) -> None:
        pass


def _config(me: str, **fields: Any) -> DilocoConfig:
    return DilocoConfig(
        cluster_id=me,
        peers=[{"cluster_id": c, "urls": ["http://127.0.0.1:1"]} for c in CLUSTERS if c != me],  # type: ignore[misc]
        secret_env="UNUSED",
        round_deadline_s=3.0,
        poll_interval_s=0.01,
        **fields,
    )


def _grad(exchange: Exchange, theta: torch.Tensor, values: torch.Tensor, **overrides: Any) -> bytes:
    cfg = exchange.cfg
    fields, body = grad_body(quantize(values, cfg.quantization, cfg.block_size), cfg.compression)
    header = exchange.header("grad", 0, 0, num_tokens=100, base_digest=tensor_digest(theta), **fields)
    return encode(header | overrides, body, SECRET)


def _round(
    hostile: bytes | None, honest: list[torch.Tensor], theta: torch.Tensor, **fields: Any
) -> tuple[list[RoundResult], list[Exchange], list[MemoryStore]]:
    """Round 0 between dc-a and dc-b (threads) with dc-z's payload ``hostile`` already served."""
    board = Board()
    if hostile is not None:
        board.items[("dc-z", "grad", 0)] = hostile
    stores = [MemoryStore(board, c) for c in CLUSTERS[:2]]
    exchanges = [
        Exchange(_config(c, **fields), s, SECRET, ["layout"])
        for c, s in zip(CLUSTERS[:2], stores, strict=True)
    ]
    payloads = [_grad(e, theta, g) for e, g in zip(exchanges, honest, strict=True)]
    momentum = torch.zeros_like(theta)
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(e.run_round, 0, 0, p, theta, momentum, list(CLUSTERS))
            for e, p in zip(exchanges, payloads, strict=True)
        ]
        results = [f.result(timeout=60) for f in futures]
    return results, exchanges, stores


def _hostile_exchange(**fields: Any) -> Exchange:
    return Exchange(_config("dc-z", **fields), None, SECRET, ["layout"])


def _reference(theta: torch.Tensor, contributions: list[tuple[float, np.ndarray]]) -> np.ndarray:
    """float64: the weighted mean, then the first Nesterov step (b = g; theta -= lr (1 + mu) g)."""
    outer = OuterOptimConfig()
    total = sum(w for w, _ in contributions)
    g = sum(w * x for w, x in contributions) / total
    return theta.double().numpy() - outer.lr * (1 + outer.momentum) * g


def _inputs() -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    theta = torch.randn(NUMEL, generator=gen)
    return theta, [0.01 * torch.randn(NUMEL, generator=gen) for _ in range(2)]


def _check_round(
    results: list[RoundResult], stores: list[MemoryStore], members: list[str], expected: np.ndarray
) -> None:
    a, b = results
    assert a.status == b.status == "applied" and a.members == b.members == members
    assert a.theta is not None and b.theta is not None
    assert torch.equal(a.theta, b.theta), "the honest DCs must end with the same bits"
    np.testing.assert_allclose(a.theta.double().numpy(), expected, rtol=1e-6, atol=1e-6)
    for store in stores:  # the hostile payload: downloaded once per round by each DC
        assert store.fetches[("dc-z", "grad", 0)] == 1, store.fetches


def _honest_only(theta: torch.Tensor, honest: list[torch.Tensor]) -> np.ndarray:
    return _reference(theta, [(1.0, g.double().numpy()) for g in honest])


@pytest.mark.parametrize(
    ("name", "overrides", "values", "reason"),
    [
        ("tokens 1e18 (dominates the average)", {"num_tokens": 10**18}, 5.0, "bad_tokens"),
        ("tokens 1e18 as a float", {"num_tokens": 1e18}, 5.0, "bad_tokens"),
        ("tokens -99 (extrapolates)", {"num_tokens": -99}, 5.0, "bad_tokens"),
        ("NaN", {}, math.nan, "non_finite"),
        ("inf", {}, math.inf, "non_finite"),
    ],
)
def test_hostile_payload_is_rejected_and_the_round_averages_the_honest_dcs(
    name: str, overrides: dict[str, Any], values: float, reason: str
) -> None:
    theta, honest = _inputs()
    # quantization = "none": the values travel as float32, NaN and inf included.
    bad = torch.full((NUMEL,), values)
    bad[::2] = 0.5
    hostile = _grad(_hostile_exchange(quantization="none"), theta, bad, **overrides)
    results, exchanges, stores = _round(hostile, honest, theta, quantization="none")
    _check_round(results, stores, ["dc-a", "dc-b"], _honest_only(theta, honest))
    for exchange in exchanges:
        assert exchange.rejected == Counter({reason: 1}), name


@pytest.mark.slow
@pytest.mark.parametrize("min_clusters", [1, 2])
def test_a_coordinator_committing_alone_is_refused_from_min_clusters_2(min_clusters: int) -> None:
    """dc-z, first candidate of the round, publishes a valid grad and a commit naming itself
    alone. With ``min_clusters = 1`` every DC applies it (the documented limit); with 2 the honest
    DCs reject it (``too_few_members``), dc-a commits on failover with all three members, and the
    weights are the float64 mean of the three contributions."""
    import hashlib

    theta, honest = _inputs()
    lone = torch.full((NUMEL,), 0.01)
    z = _hostile_exchange(quantization="none", min_clusters=min_clusters)
    grad = _grad(z, theta, lone)
    commit = z.header(
        "commit",
        0,
        0,
        base_digest=tensor_digest(theta),
        members=[["dc-z", hashlib.sha256(grad).hexdigest(), 100]],
        next_candidates=["dc-z"],
    )
    board = Board()
    board.items[("dc-z", "grad", 0)] = grad
    board.items[("dc-z", "commit", 0)] = encode(commit, b"", SECRET)
    stores = [MemoryStore(board, c) for c in CLUSTERS[:2]]
    exchanges = [
        Exchange(_config(c, quantization="none", min_clusters=min_clusters), s, SECRET, ["layout"])
        for c, s in zip(CLUSTERS[:2], stores, strict=True)
    ]
    payloads = [_grad(e, theta, g) for e, g in zip(exchanges, honest, strict=True)]
    candidates = ["dc-z", "dc-a", "dc-b"]  # dc-z coordinates this round
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(e.run_round, 0, 0, p, theta, torch.zeros_like(theta), candidates)
            for e, p in zip(exchanges, payloads, strict=True)
        ]
        results = [f.result(timeout=60) for f in futures]
    if min_clusters == 1:
        expected = _reference(theta, [(1.0, lone.double().numpy())])
        members = ["dc-z"]
    else:
        expected = _reference(theta, [(1.0, g.double().numpy()) for g in [*honest, lone]])
        members = ["dc-a", "dc-b", "dc-z"]
        for exchange in exchanges:
            assert exchange.rejected == Counter({"too_few_members": 1})
        assert {r.committer for r in results} == {"dc-a"}
    a, b = results
    assert a.status == b.status == "applied" and a.members == b.members == members
    assert a.theta is not None and b.theta is not None and torch.equal(a.theta, b.theta)
    np.testing.assert_allclose(a.theta.double().numpy(), expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(PayloadError, match="too_few_members"):
        check_commit(commit, CLUSTERS, 2)
    check_commit(commit | {"members": []}, CLUSTERS, 2)  # no step at all stays allowed


def test_finite_3e38_pseudo_gradient_is_clipped_to_ten_times_the_others_median_norm() -> None:
    theta, honest = _inputs()
    huge = torch.full((NUMEL,), 3e38)
    hostile = _grad(_hostile_exchange(quantization="none"), theta, huge)
    results, exchanges, stores = _round(hostile, honest, theta, quantization="none")
    # By hand: dc-z's reference norm is the median of the honest norms (the mean of two); its
    # vector keeps its direction at 10x that norm. The honest ones are far below 10x theirs.
    norms = [float(np.linalg.norm(g.double().numpy())) for g in honest]
    z = huge.double().numpy()
    z_clipped = z * (10 * statistics.median(norms) / np.linalg.norm(z))
    expected = _reference(
        theta, [(1.0, honest[0].double().numpy()), (1.0, honest[1].double().numpy()), (1.0, z_clipped)]
    )
    _check_round(results, stores, CLUSTERS, expected)
    assert all(r.metrics["diloco/num_clipped"] == 1.0 for r in results)
    assert all(not e.rejected for e in exchanges)


def test_capped_token_weighting_opt_in() -> None:
    """tokens 100, 100 and 10**11: the last weighs 2 x the median (200), not 10**11."""
    theta, honest = _inputs()
    z = 0.01 * torch.randn(NUMEL, generator=torch.Generator().manual_seed(3))
    validation = ValidationConfig(token_weighting=True)
    hostile = _grad(
        _hostile_exchange(quantization="none", validation=validation), theta, z, num_tokens=10**11
    )
    results, _, stores = _round(hostile, honest, theta, quantization="none", validation=validation)
    contributions = [
        (100.0, honest[0].double().numpy()),
        (100.0, honest[1].double().numpy()),
        (200.0, z.double().numpy()),
    ]
    _check_round(results, stores, CLUSTERS, _reference(theta, contributions))


def test_trimmed_mean_of_three_is_the_coordinatewise_median() -> None:
    theta, honest = _inputs()
    z = torch.full((NUMEL,), 0.05)  # within the clip limit, but the largest value everywhere
    validation = ValidationConfig(aggregation="trimmed_mean", trim_fraction=0.34)
    hostile = _grad(_hostile_exchange(quantization="none", validation=validation), theta, z)
    results, _, stores = _round(hostile, honest, theta, quantization="none", validation=validation)
    stacked = np.stack([honest[0].double().numpy(), honest[1].double().numpy(), z.double().numpy()])
    _check_round(results, stores, CLUSTERS, _reference(theta, [(1.0, np.median(stacked, axis=0))]))


def test_oversized_payload_is_capped_rejected_and_fetched_once() -> None:
    theta, honest = _inputs()
    garbage = MAGIC + bytes(8) + np.random.default_rng(0).bytes(4 << 20)
    results, exchanges, stores = _round(garbage, honest, theta)  # int8, blocks of 128, zlib
    _check_round(results, stores, ["dc-a", "dc-b"], _reference_int8(theta, honest))
    # By hand: 64 int8 values fill one block of 128 codes + one float32 scale = 132 bytes,
    # which zlib may grow by 13; plus the frame (magic, length, tag) and the header cap.
    cap = len(MAGIC) + 8 + MAX_HEADER_BYTES + 132 + 13 + TAG_BYTES
    for exchange, store in zip(exchanges, stores, strict=True):
        assert store.caps[("dc-z", "grad", 0)] == cap
        assert exchange.rejected == Counter({"oversize": 1})


def _reference_int8(theta: torch.Tensor, honest: list[torch.Tensor]) -> np.ndarray:
    """The honest mean after int8 absmax quantization of each (one block, by hand)."""
    deq = []
    for g in honest:
        x = g.double().numpy()
        scale = np.abs(x).max()
        deq.append(np.round(x / scale * 127) * (scale / 127))
    return _reference(theta, [(1.0, d) for d in deq])


def test_settings_mismatch_is_rejected() -> None:
    theta, honest = _inputs()
    other = _hostile_exchange(validation=ValidationConfig(norm_clip_ratio=None))
    results, exchanges, stores = _round(_grad(other, theta, honest[0]), honest, theta)
    _check_round(results, stores, ["dc-a", "dc-b"], _reference_int8(theta, honest))
    assert all(e.rejected == Counter({"wrong_validation": 1}) for e in exchanges)


# ---------------------------------------------------------------------------------- the parsers


HEADER = {"run_id": "r", "cluster": "dc-a", "kind": "grad", "round": 3, "fragment": 1}


def _parse(values: torch.Tensor, kind: str = "none", body: bytes | None = None, **overrides: Any) -> Any:
    fields, raw = grad_body(quantize(values, kind, 16), "none")  # type: ignore[arg-type]
    header = {**HEADER, **fields, "num_tokens": 7, "base_digest": "x", **overrides}
    data = encode(header, raw if body is None else body, SECRET)
    return parse_grad(*decode(data, SECRET, HEADER), digest="d", max_num_tokens=1000)


@pytest.mark.parametrize("num_tokens", [1001, -1, 7.0, True, "7", None])
def test_token_counts_out_of_bounds_are_rejected(num_tokens: object) -> None:
    with pytest.raises(PayloadError) as e:
        _parse(torch.ones(4), num_tokens=num_tokens)
    assert e.value.reason == "bad_tokens"
    assert _parse(torch.ones(4), num_tokens=1000).num_tokens == 1000


def test_codes_and_scales_outside_what_quantize_writes_are_rejected() -> None:
    x = torch.linspace(-1, 1, 16)
    _, body = grad_body(quantize(x, "int8", 16), "none")
    cases = {
        "int8 code -128": (b"\x00" + body[1:], "int8"),
        "negative scale": (body[:16] + np.float32(-1.0).tobytes(), "int8"),
        "inf scale": (body[:16] + np.float32(np.inf).tobytes(), "int8"),
    }
    _, body4 = grad_body(quantize(x, "int4", 16), "none")
    cases["int4 code -8"] = (bytes([body4[0] & 0xF0]) + body4[1:], "int4")
    for name, (bad, kind) in cases.items():
        with pytest.raises(PayloadError, match="malformed") as e:
            _parse(x, kind, body=bad)
        assert e.value.reason == "malformed", name


def test_zlib_bomb_is_rejected_without_inflating_it() -> None:
    bomb = zlib.compress(bytes(64 << 20), 9)  # 64 MiB of zeros in ~65 KB
    fields, _ = grad_body(quantize(torch.ones(4), "none", 16), "zlib")
    data = encode({**HEADER, **fields, "num_tokens": 1, "base_digest": "x"}, bomb, SECRET)
    with pytest.raises(PayloadError) as e:
        parse_grad(*decode(data, SECRET, HEADER), digest="d")
    assert e.value.reason == "malformed" and "decompress" in str(e.value)


def test_decode_rejects_oversize_payloads_and_headers() -> None:
    data = encode(HEADER, b"x" * 100, SECRET)
    assert decode(data, SECRET, HEADER, max_bytes=len(data))[1] == b"x" * 100
    with pytest.raises(PayloadError) as e:
        decode(data, SECRET, HEADER, max_bytes=len(data) - 1)
    assert e.value.reason == "oversize"
    big_header = encode(HEADER | {"pad": "p" * MAX_HEADER_BYTES}, b"", SECRET)
    with pytest.raises(PayloadError) as e:
        decode(big_header, SECRET, HEADER)
    assert e.value.reason == "oversize"


@pytest.mark.parametrize(
    ("kind", "body"), [("none", 4 * 1000), ("int8", 1024 + 4 * 8), ("int4", 512 + 4 * 8)]
)
def test_max_payload_bytes_by_hand_and_worst_case_payloads_fit(kind: str, body: int) -> None:
    frame = len(MAGIC) + 8 + MAX_HEADER_BYTES + TAG_BYTES
    assert max_payload_bytes("grad", 1000, kind, 128, "none") == frame + body  # type: ignore[arg-type]
    # 1000 values in blocks of 128: 8 blocks (1024 codes, 512 bytes for int4) + 8 scales.
    zlib_bound = body + (body >> 12) + (body >> 14) + 13
    assert max_payload_bytes("grad", 1000, kind, 128, "zlib") == frame + zlib_bound  # type: ignore[arg-type]
    assert max_payload_bytes("state", 1000) == frame + 8000
    assert max_payload_bytes("commit", 1000) == frame
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))  # incompressible-ish
    for compression in ("none", "zlib"):
        fields, data = grad_body(quantize(x, kind, 128), compression)  # type: ignore[arg-type]
        header = {**HEADER, **fields, "num_tokens": 10**12, "base_digest": "a" * 64, "layout": "b" * 64}
        payload = encode(header, data, SECRET)
        assert len(payload) <= max_payload_bytes("grad", 1000, kind, 128, compression)  # type: ignore[arg-type]


def test_commits_must_name_distinct_dcs_of_the_run() -> None:
    ids = ["dc-a", "dc-b"]
    good = {"base_digest": "x", "members": [["dc-a", "a" * 64, 5]], "next_candidates": ["dc-a"]}
    check_commit(good, ids)
    bad = [
        good | {"members": [["dc-a", "a" * 64, 5], ["dc-a", "b" * 64, 5]]},
        good | {"members": [["dc-q", "a" * 64, 5]]},
        good | {"members": [["dc-a", "a" * 64, "5"]]},
        good | {"members": [["dc-a", "short", 5]]},
        good | {"members": [["dc-a"]]},
        good | {"members": "dc-a"},
        good | {"next_candidates": ["dc-q"]},
    ]
    for header in bad:
        with pytest.raises(PayloadError, match="malformed"):
            check_commit(header, ids)


# ------------------------------------------------------------------------------------- the rules


def test_weights_uniform_by_default_and_capped_when_opted_in() -> None:
    assert token_weights([100, 10**6, 0], ValidationConfig()) == [1.0, 1.0, 0.0]
    assert token_weights([0, 0], ValidationConfig()) == [1.0, 1.0]
    # median of (100, 300, 10**9) is 300; cap 2 x 300 = 600.
    weighted = ValidationConfig(token_weighting=True)
    assert token_weights([100, 300, 10**9, 0], weighted) == [100.0, 300.0, 600.0, 0.0]


def test_norm_clipping_by_hand() -> None:
    xs = [torch.tensor([3.0, 4.0]), torch.tensor([0.0, 1.0]), torch.tensor([300.0, 400.0])]
    # Norms 5, 1, 500. The others' medians: (1 + 500) / 2, (5 + 500) / 2, (5 + 1) / 2 = 3, so
    # only the last is clipped, to 10 x 3 = 30: (300, 400) * 30 / 500 = (18, 24).
    assert clip_factors([5.0, 1.0, 500.0], [1.0, 1.0, 1.0], 10.0) == [1.0, 1.0, 30 / 500]
    result = aggregate([1, 1, 1], xs, ValidationConfig())
    assert result.clipped == [2]
    torch.testing.assert_close(result.grad, torch.tensor([21 / 3, 29 / 3]))
    # A member that trained on nothing is neither a reference nor averaged.
    assert clip_factors([5.0, 0.0, 500.0], [1.0, 0.0, 1.0], 10.0) == [1.0, 1.0, 50 / 500]
    assert clip_factors([5.0, 500.0], [1.0, 1.0], None) == [1.0, 1.0]


def test_trimmed_mean_by_hand() -> None:
    xs = [
        torch.tensor([1.0, 10.0]),
        torch.tensor([2.0, -50.0]),
        torch.tensor([100.0, 20.0]),
        torch.tensor([3.0, 30.0]),
    ]
    # k = floor(0.25 * 4) = 1 a side: column 0 keeps 2, 3; column 1 keeps 10, 20.
    torch.testing.assert_close(trimmed_mean(xs, 0.25), torch.tensor([2.5, 15.0]))
    torch.testing.assert_close(trimmed_mean(xs, 0.0), torch.tensor([106 / 4, 10 / 4]))


def test_l2_norm_matches_an_exactly_rounded_sum_over_several_chunks() -> None:
    x = torch.randn(2_500_000, generator=torch.Generator().manual_seed(1)) * 1e3
    exact = math.sqrt(math.fsum(float(v) ** 2 for v in x.double().tolist()))
    assert l2_norm(x) == pytest.approx(exact, rel=1e-12)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = l2_norm(x)
    finally:
        torch.set_num_threads(before)
    assert one == l2_norm(x)


def test_config_bounds_and_conflicts() -> None:
    with pytest.raises(pydantic.ValidationError, match="token_weighting"):
        ValidationConfig(aggregation="trimmed_mean", token_weighting=True)
    for bad in (
        {"norm_clip_ratio": 0.5},
        {"token_weight_cap": 0.9},
        {"trim_fraction": 0.5},
        {"max_num_tokens": 0},
    ):
        with pytest.raises(pydantic.ValidationError):
            ValidationConfig(**bad)  # type: ignore[arg-type]
    cfg = DilocoConfig.model_validate({"validation": {"aggregation": "trimmed_mean"}})
    assert cfg.validation.aggregation == "trimmed_mean" and cfg.validation.norm_clip_ratio == 10.0


def test_own_invalid_payload_is_not_sent_and_the_weights_stay() -> None:
    theta, _ = _inputs()
    alone = Exchange(
        _config("dc-a", quantization="none").model_copy(update={"peers": []}), None, SECRET, ["layout"]
    )
    bad = _grad(alone, theta, torch.full((NUMEL,), math.nan))
    result = alone.run_round(0, 0, bad, theta, torch.zeros_like(theta), ["dc-a"])
    assert result.status == "applied" and result.members == [] and result.theta is not None
    assert torch.equal(result.theta, theta) and alone.rejected == Counter({"non_finite": 1})

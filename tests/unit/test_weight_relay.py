"""Published weights through a relay near the workers (``transport/remote.py``: origin -> relay ->
worker), on 127.0.0.1 with pinned TLS on both hops: the relay fetches each step once whatever the
number of workers, checks what it receives before it keeps or serves it, and holds no key that
signs a manifest; a relay that serves altered bytes (or a manifest rewritten to match them) is
caught by the worker, which falls back to the origin, or fails naming every source; a relay that
is down costs one failed call; requests signed for one hop are refused at the other."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from prime_composer.config.ports import free_port
from prime_composer.integrity import MANIFEST_NAME
from prime_composer.transport import remote
from prime_composer.transport.remote import (
    AUDIENCE,
    RELAY_AUDIENCE,
    RemoteWeights,
    RemoteWeightsError,
    WeightsOrigin,
    WeightsRelay,
    fetch_step,
    relay_key,
    relay_request_key,
    request_key,
)
from prime_composer.transport.weights import load_weights, publish_weights
from prime_composer.wire.auth import AUTH_HEADER, sign_request
from prime_composer.wire.fetch import Peer, request
from prime_composer.wire.tls import generate, server_context

SECRET = b"weights-relay-secret-3f1a"


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed.weight": torch.randn(32, 8, generator=g),
        "lm_head.bias": torch.randn(32, generator=g),
    }


def _tls(tmp_path: Path, name: str):  # type: ignore[no-untyped-def]
    pin = generate(tmp_path / name, name)
    return pin, server_context(tmp_path / name / "cert.pem", tmp_path / name / "key.pem")


@pytest.fixture
def hops(tmp_path: Path):  # type: ignore[no-untyped-def]
    """An origin serving steps 1 and 2 and a relay in front of it, each with its own certificate."""
    broadcasts = tmp_path / "trainer" / "broadcasts"
    for step in (1, 2):
        publish_weights(_state(step), {"model_type": "toy"}, broadcasts, step)
    origin_pin, origin_tls = _tls(tmp_path, "origin")
    origin = WeightsOrigin(broadcasts, "127.0.0.1", 0, SECRET, tls=origin_tls)
    origin_url = f"https://127.0.0.1:{origin.port}"
    relay_pin, relay_tls = _tls(tmp_path, "relay")
    relay = WeightsRelay(
        tmp_path / "relay-cache", "127.0.0.1", 0, relay_key(SECRET), origin_url, origin_pin, tls=relay_tls
    )
    yield {
        "origin": origin,
        "origin_url": origin_url,
        "origin_pin": origin_pin,
        "relay": relay,
        "relay_at": (f"https://127.0.0.1:{relay.port}", relay_pin),
        "broadcasts": broadcasts,
        "cache": tmp_path / "relay-cache",
    }
    relay.close()
    origin.close()


def _dead_url() -> str:
    return f"https://127.0.0.1:{free_port()}"  # nothing listens there


def _assert_state(path: Path, step: int) -> None:
    loaded, expected = load_weights(path), _state(step)
    assert loaded.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(loaded[k], v), k


def test_workers_fetch_through_the_relay_which_fetches_each_step_once(hops, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # The workers cannot reach the origin at all: every byte they load came through the relay.
    source = RemoteWeights(
        _dead_url(), "sha256:" + "00" * 32, SECRET, timeout_s=30, relays=(hops["relay_at"],)
    )
    results: dict[int, Path | BaseException] = {}

    def worker(i: int) -> None:
        try:
            results[i] = source.fetch(2, tmp_path / f"worker-{i}")
        except BaseException as e:
            results[i] = e

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for i in range(3):
        path = results[i]
        assert isinstance(path, Path), path
        assert path == (tmp_path / f"worker-{i}" / "step_2").resolve()
        _assert_state(path, 2)
    assert hops["relay"].upstream_fetches == 1  # three workers, one crossing to the origin
    # The relay kept the origin's end-to-end tag as it came, not one of its own making.
    cached = hops["cache"] / "step_2"
    manifest = (cached / MANIFEST_NAME).read_bytes()
    tag = remote.manifest_tag(remote.manifest_key(SECRET), 2, manifest)
    assert (cached / remote.SIGNATURE_NAME).read_text() == tag
    # /latest through the relay is the origin's.
    deadline = time.monotonic() + 10
    relay_peer = Peer(
        hops["relay_at"][0], RELAY_AUDIENCE, relay_request_key(relay_key(SECRET)), hops["relay_at"][1]
    )
    assert request(relay_peer, "GET", "latest", deadline, 4096) == (200, b'{"step": 2}')


def test_a_relay_serving_altered_bytes_is_caught_and_the_worker_falls_back(
    hops, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    relay_only = RemoteWeights(
        _dead_url(), "sha256:" + "00" * 32, SECRET, timeout_s=20, relays=(hops["relay_at"],)
    )
    both = RemoteWeights(
        hops["origin_url"], hops["origin_pin"], SECRET, timeout_s=20, relays=(hops["relay_at"],)
    )
    relay_only.fetch(2, tmp_path / "warm")  # the relay now holds step 2
    weights = hops["cache"] / "step_2" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-5] ^= 0x10  # one bit flipped on the relay's disk (or by the relay)
    weights.write_bytes(bytes(raw))
    with pytest.raises(RemoteWeightsError) as caught:
        relay_only.fetch(2, tmp_path / "w1")
    message = str(caught.value)
    assert "relay https://127.0.0.1" in message and "does not match its manifest" in message
    assert "origin " in message  # and the origin was tried too
    assert not (tmp_path / "w1" / "step_2").exists()
    with caplog.at_level(logging.WARNING, logger=remote.__name__):
        path = both.fetch(2, tmp_path / "w2")
    _assert_state(path, 2)  # the origin's bytes, not the relay's
    assert any(
        "from relay" in r.getMessage() and "trying the next source" in r.getMessage() for r in caplog.records
    )
    # A relay that rewrites the manifest to match its altered bytes (it can make the relay hop's
    # tag, which the worker does not trust) fails the end-to-end tag, which it cannot make.
    import hashlib
    import json

    manifest_path = hops["cache"] / "step_2" / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["model.safetensors"]["sha256"] = hashlib.sha256(bytes(raw)).hexdigest()
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(RemoteWeightsError, match="not signed with the run's secret"):
        relay_only.fetch(2, tmp_path / "w3")
    _assert_state(both.fetch(2, tmp_path / "w4"), 2)


def test_the_relay_checks_what_it_receives_before_keeping_or_serving_it(hops, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # Altered on the way to the relay (here: on the origin's disk, as a corrupting hop would):
    # the relay answers 502 naming why and keeps nothing of the step.
    weights = hops["broadcasts"] / "step_1" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-7] ^= 0x01
    weights.write_bytes(bytes(raw))
    relay_only = RemoteWeights(
        _dead_url(), "sha256:" + "00" * 32, SECRET, timeout_s=20, relays=(hops["relay_at"],)
    )
    with pytest.raises(RemoteWeightsError, match=r"HTTP 502 .*does not match its manifest"):
        relay_only.fetch(1, tmp_path / "w")
    assert hops["relay"].upstream_fetches == 0
    assert [p.name for p in hops["cache"].iterdir()] == []  # no half step, no hidden leftovers
    # A manifest altered on the way fails the relay hop's tag: the relay refuses it too.
    real_get = remote._get

    def altered(peer: Peer, path: str, deadline: float, max_bytes: int) -> bytes:
        data = real_get(peer, path, deadline, max_bytes)
        return (
            data.replace(b'"bytes"', b'"bytes" ')
            if path.endswith(MANIFEST_NAME) and peer.audience == AUDIENCE
            else data
        )

    remote._get = altered  # type: ignore[assignment]
    try:
        with pytest.raises(RemoteWeightsError, match=r"HTTP 502 .*not signed"):
            fetch_step(*hops["relay_at"], SECRET, 2, tmp_path / "w", 20, via_relay=True)
    finally:
        remote._get = real_get  # type: ignore[assignment]
    # A relay given another run's key is refused by the origin (its workers get a 502).
    stranger = WeightsRelay(
        tmp_path / "other-cache",
        "127.0.0.1",
        0,
        relay_key(b"another secret"),
        hops["origin_url"],
        hops["origin_pin"],
    )
    try:
        with pytest.raises(RemoteWeightsError, match=r"HTTP 502 .*HTTP 401"):
            fetch_step(
                f"http://127.0.0.1:{stranger.port}",
                None,
                b"another secret",
                2,
                tmp_path / "w",
                20,
                via_relay=True,
            )
    finally:
        stranger.close()


def test_a_relay_that_is_down_costs_one_failed_call(hops, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    hops["relay"].close()
    both = RemoteWeights(
        hops["origin_url"], hops["origin_pin"], SECRET, timeout_s=20, relays=(hops["relay_at"],)
    )
    start = time.monotonic()
    _assert_state(both.fetch(1, tmp_path / "w"), 1)
    assert time.monotonic() - start < 15  # connection refused, not a deadline
    hops["relay"] = WeightsRelay(
        hops["cache"], "127.0.0.1", 0, relay_key(SECRET), hops["origin_url"], hops["origin_pin"]
    )


def test_each_hop_takes_only_requests_signed_for_it(hops) -> None:  # type: ignore[no-untyped-def]
    relay_url, relay_pin = hops["relay_at"]
    deadline = time.monotonic() + 10
    relay_req = relay_request_key(relay_key(SECRET))
    # The relay refuses unsigned requests and requests made for the origin.
    assert (
        request(Peer(relay_url, RELAY_AUDIENCE, None, relay_pin), "GET", "latest", deadline, 4096)[0] == 401
    )
    for_origin = Peer(relay_url, AUDIENCE, request_key(SECRET), relay_pin)
    assert request(for_origin, "GET", "latest", deadline, 4096)[0] == 401
    assert request(Peer(relay_url, AUDIENCE, relay_req, relay_pin), "GET", "latest", deadline, 4096)[0] == 401
    # A request a worker signed for the relay, replayed at the origin: another audience, a 401.
    header = sign_request(relay_req, "GET", "/latest", b"", RELAY_AUDIENCE)
    import http.client
    import ssl

    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    conn = http.client.HTTPSConnection("127.0.0.1", hops["origin"].port, context=ctx, timeout=10)
    conn.request("GET", "/latest", headers={AUTH_HEADER: header})
    answer = conn.getresponse()
    assert answer.status == 401 and b"not to this server" in answer.read()
    conn.close()
    # The relay's key is none of the keys that sign what workers trust.
    key = relay_key(SECRET)
    assert key not in (SECRET, request_key(SECRET), remote.manifest_key(SECRET))


def test_the_inference_config_takes_relays_before_the_origin(monkeypatch: pytest.MonkeyPatch) -> None:
    from prime_composer.config.inference import InferenceConfig
    from prime_composer.inference.hf.server import _remote

    pin = "sha256:" + "ab" * 32
    monkeypatch.setenv("WEIGHTS_SECRET", SECRET.decode())
    config = InferenceConfig(
        weights_origin=f"https://10.0.0.1:7900@{pin}",
        weights_relays=[f"https://10.1.0.9:7901@{pin.upper()}", "http://127.0.0.1:7902"],
        weights_secret_env="WEIGHTS_SECRET",
    )
    source = _remote(config)
    assert source.url == "https://10.0.0.1:7900" and source.fingerprint == pin
    assert source.relays == (("https://10.1.0.9:7901", pin), ("http://127.0.0.1:7902", None))
    assert "ab" * 32 not in repr(source.secret) and SECRET.decode() not in repr(source)
    cases = {
        "weights_relays[0] = 'https://10.1.0.9:7901': pin the certificate": {
            "weights_relays": ["https://10.1.0.9:7901"]
        },
        r"weights_relays\[1\] = 'http://10.1.0.9:7901': plain HTTP off loopback": {
            "weights_relays": [f"https://10.1.0.8:1@{pin}", "http://10.1.0.9:7901"]
        },
    }
    for message, fields in cases.items():
        with pytest.raises(
            ValueError, match=message.replace("[0]", r"\[0\]").replace(".weights_origin", r"\.weights_origin")
        ):
            InferenceConfig(weights_origin=f"https://10.0.0.1:7900@{pin}", weights_secret_env="W", **fields)
    with pytest.raises(ValueError, match="weights_relays is set but inference\\.weights_origin is not"):
        InferenceConfig(weights_relays=[f"https://10.1.0.8:1@{pin}"])
    # The vllm backend takes the same relays: the launcher hands them to the admin routes in vLLM's
    # process, which build the same source.
    import json

    from prime_composer.inference.vllm import admin
    from prime_composer.inference.vllm.launch import build_vllm_env

    vllm = InferenceConfig(**{**config.model_dump(), "backend": "vllm"})
    settings = json.loads(build_vllm_env(vllm, base_env={})[admin.SETTINGS_ENV])
    assert SECRET.decode() not in json.dumps(settings)  # the variable's name only
    in_vllm = admin._remote(settings["weights_origin"])
    assert (in_vllm.url, in_vllm.fingerprint, in_vllm.relays) == (
        source.url,
        source.fingerprint,
        source.relays,
    )

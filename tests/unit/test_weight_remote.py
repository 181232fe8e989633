"""Published weights fetched over pinned HTTPS by a worker with no shared folder
(``transport/remote.py``): the fetched step loads to the very tensors the trainer published, and a
file altered on the origin's disk, a manifest rewritten to match it, a step served in another's
place, a wrong secret, an unsigned request and a path outside the steps are all refused, with
nothing left in the worker's root."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from prime_composer.transport import remote
from prime_composer.transport.remote import (
    RemoteWeightsError,
    WeightsOrigin,
    fetch_step,
    latest_step,
    request_key,
)
from prime_composer.transport.weights import is_stable, load_weights, publish_weights
from prime_composer.wire.fetch import Peer, request
from prime_composer.wire.tls import generate, server_context

SECRET = b"weights-remote-secret-91c2"


@pytest.fixture
def origin(tmp_path: Path):  # type: ignore[no-untyped-def]
    pin = generate(tmp_path / "tls", "trainer")
    tls = server_context(tmp_path / "tls" / "cert.pem", tmp_path / "tls" / "key.pem")
    server = WeightsOrigin(tmp_path / "broadcasts", "127.0.0.1", 0, SECRET, tls=tls)
    yield f"https://127.0.0.1:{server.port}", pin, tmp_path / "broadcasts"
    server.close()


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed.weight": torch.randn(16, 8, generator=g),
        "lm_head.bias": torch.randn(16, generator=g),
    }


def test_the_origin_shares_the_step_layout_of_transport_weights(tmp_path: Path) -> None:
    from prime_composer.transport import weights

    assert remote.STABLE_MARKER == weights.STABLE_MARKER
    for step in (3, 12):
        publish_weights(_state(step), {"model_type": "toy"}, tmp_path, step)
    (tmp_path / "step_40").mkdir()  # not STABLE
    assert remote.latest_stable(tmp_path) == weights.latest_stable(tmp_path) == (12, tmp_path / "step_12")
    assert remote.step_path(tmp_path, 3) == weights.step_path(tmp_path, 3)


def test_a_fetched_step_loads_to_the_published_tensors(origin, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    url, pin, broadcasts = origin
    assert latest_step(url, pin, SECRET) is None
    for step in (1, 2):
        publish_weights(_state(step), {"model_type": "toy"}, broadcasts, step)
    assert latest_step(url, pin, SECRET) == 2
    worker_root = tmp_path / "worker"
    path = fetch_step(url, pin, SECRET, 2, worker_root)
    assert path == worker_root / "step_2" and is_stable(path)
    loaded = load_weights(path)
    expected = _state(2)
    assert loaded.keys() == expected.keys()
    for k in expected:
        assert torch.equal(loaded[k], expected[k])
    assert json.loads((path / "config.json").read_text())["model_type"] == "toy"


def test_altered_or_substituted_steps_are_refused(
    origin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    url, pin, broadcasts = origin
    for step in (1, 2):
        publish_weights(_state(step), {"model_type": "toy"}, broadcasts, step)
    worker_root = tmp_path / "worker"
    weights = broadcasts / "step_2" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-3] ^= 0x40
    weights.write_bytes(bytes(raw))
    with pytest.raises(RemoteWeightsError, match="does not match its manifest"):
        fetch_step(url, pin, SECRET, 2, worker_root)
    # A middlebox (a relay, a proxy) that alters the manifest to match altered weights, or
    # serves step 1's bytes when step 2 is asked for: the manifest's tag fails.
    real_get = remote._get

    def altered_manifest(peer: Peer, path: str, deadline: float, max_bytes: int) -> bytes:
        data = real_get(peer, path, deadline, max_bytes)
        return data.replace(b'"bytes"', b'"bytes" ') if path.endswith("MANIFEST.json") else data

    def older_step(peer: Peer, path: str, deadline: float, max_bytes: int) -> bytes:
        return real_get(peer, path.replace("step_2/", "step_1/"), deadline, max_bytes)

    for middlebox in (altered_manifest, older_step):
        monkeypatch.setattr(remote, "_get", middlebox)
        with pytest.raises(RemoteWeightsError, match="not signed with the run's secret"):
            fetch_step(url, pin, SECRET, 2, worker_root)
    monkeypatch.setattr(remote, "_get", real_get)
    # An origin that does not hold the run's secret refuses the worker's requests.
    other = WeightsOrigin(broadcasts, "127.0.0.1", 0, b"another-secret")
    try:
        with pytest.raises(RemoteWeightsError, match="HTTP 401"):
            fetch_step(f"http://127.0.0.1:{other.port}", None, SECRET, 1, worker_root)
    finally:
        other.close()
    assert sorted(p.name for p in worker_root.iterdir()) == []  # nothing half-written is left
    # Unsigned requests, other keys and paths outside the steps.
    deadline = time.monotonic() + 5
    assert request(Peer(url, "weights", None, pin), "GET", "latest", deadline, 4096)[0] == 401
    assert request(Peer(url, "weights", b"k" * 32, pin), "GET", "latest", deadline, 4096)[0] == 401
    key = request_key(SECRET)
    for path in ("step_1/../step_2/config.json", "step_1/STABLE", "etc/passwd", "step_1/"):
        assert request(Peer(url, "weights", key, pin), "GET", path, deadline, 4096)[0] == 404, path
    with pytest.raises(RemoteWeightsError, match="pin"):
        fetch_step(url, "sha256:" + "00" * 32, SECRET, 1, worker_root)


class _Recorder:
    """A ``WeightTarget`` that loads what it is given as the hf server does (``load_weights``)."""

    def __init__(self) -> None:
        self.loaded: list[tuple[Path, dict[str, torch.Tensor]]] = []

    async def load_weights(self, path: Path) -> None:
        self.loaded.append((path, load_weights(path)))

    async def load_adapter(self, path: Path) -> None:
        raise AssertionError("no adapter here")

    async def reload_base(self) -> None:
        raise AssertionError("not called")


def test_update_weights_fetches_the_named_step_from_the_trainer_side(origin, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    from prime_composer.inference.guard import APIError
    from prime_composer.inference.weight_updates import WeightUpdates
    from prime_composer.transport.remote import RemoteWeights

    url, pin, broadcasts = origin
    publish_weights(_state(5), {"model_type": "toy"}, broadcasts, 5)
    worker_root = tmp_path / "worker" / "broadcasts"
    updates = WeightUpdates(worker_root, remote=RemoteWeights(url, pin, SECRET))
    target = _Recorder()
    # The orchestrator names the trainer's own path, which does not exist on the worker.
    body = json.dumps({"path": str(broadcasts.resolve() / "step_5")}).encode()
    answer = asyncio.run(updates.update(body, target))
    assert answer["step"] == 5 and answer["path"] == str((worker_root / "step_5").resolve())
    assert updates.current["step"] == 5
    ((path, state),) = target.loaded
    assert path.is_relative_to(worker_root.resolve())
    for k, v in _state(5).items():
        assert torch.equal(state[k], v)
    # A step the trainer side does not have: 502, and what is served stays.
    with pytest.raises(APIError) as caught:
        asyncio.run(updates.update(json.dumps({"path": "step_9"}).encode(), target))
    assert caught.value.status == 502 and "step 9" in caught.value.message
    assert updates.current["step"] == 5 and len(target.loaded) == 1


def test_files_stream_through_both_ends(origin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """A weights file is never read whole by the origin nor held whole by the worker: it goes by
    chunks (1 MiB at the origin, 64 KiB reads at the worker) straight to disk, digest checked."""
    url, pin, broadcasts = origin
    g = torch.Generator().manual_seed(7)
    big = {"model.embed.weight": torch.randn(1024, 1024, generator=g)}  # a 4 MiB file
    publish_weights(big, {"model_type": "toy"}, broadcasts, 1)
    real_read_bytes = Path.read_bytes

    def no_whole_weights(self: Path) -> bytes:
        assert not self.name.endswith(".safetensors"), f"{self} read whole"
        return real_read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", no_whole_weights)
    chunks: list[int] = []
    real_request = remote.request

    def counting_request(*args, **kwargs):  # type: ignore[no-untyped-def]
        sink = kwargs.get("sink")
        if sink is not None:
            kwargs["sink"] = lambda chunk: (chunks.append(len(chunk)), sink(chunk))
        status, body = real_request(*args, **kwargs)
        assert sink is None or body == b""  # nothing collected in memory
        return status, body

    monkeypatch.setattr(remote, "request", counting_request)
    path = fetch_step(url, pin, SECRET, 1, tmp_path / "worker")
    monkeypatch.setattr(Path, "read_bytes", real_read_bytes)
    assert torch.equal(load_weights(path)["model.embed.weight"], big["model.embed.weight"])
    assert sum(chunks) > 4 << 20 and max(chunks) <= 1 << 16 and len(chunks) > 64
    # A file cut short on the origin's disk: refused, nothing left behind.
    (broadcasts / "step_1" / "model.safetensors").write_bytes(b"x" * 10)
    with pytest.raises(RemoteWeightsError):
        fetch_step(url, pin, SECRET, 1, tmp_path / "worker2")
    assert not any((tmp_path / "worker2").glob("step_*"))

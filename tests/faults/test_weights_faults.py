"""Broken published weights, one scenario per test: each is refused with a message naming the file
or tensor, on the trainer side (``publish_weights``), on load (``load_weights``), by the hf server
(409, and it keeps serving the weights it had) and by the vLLM backend's middleware and worker
extension (409 from a fake engine client; the real vLLM run is tests/integration/test_vllm_backend.py).

Digests are checked against hashlib directly, not against the code's own reader.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file
from starlette.applications import Starlette
from starlette.testclient import TestClient

from prime_composer.config.inference import InferenceConfig
from prime_composer.inference.local import running_server
from prime_composer.inference.vllm.admin import AdminRoutesMiddleware
from prime_composer.inference.vllm.extension import WeightUpdateExtension
from prime_composer.integrity import MANIFEST_NAME, IntegrityError, write_manifest
from prime_composer.model.resolve import resolve_model_name
from prime_composer.transport.weights import (
    INDEX_NAME,
    WEIGHTS_NAME,
    NonFiniteWeightsError,
    load_weights,
    publish_weights,
)

MODEL = "builtin:tiny-qwen3"
NORM = "model.norm.weight"


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(resolve_model_name(MODEL), dtype=torch.float32).eval()


def _state(model: torch.nn.Module, shift: float = 0.0) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() + shift for k, v in model.state_dict().items()}


def _publish(model: torch.nn.Module, root: Path, step: int, shift: float = 0.0) -> Path:
    return publish_weights(_state(model, shift), model.config, root, step)


def _corrupt(path: Path, how: str) -> None:
    """Damage ``path/model.safetensors`` in place, leaving its manifest as it was."""
    file = path / WEIGHTS_NAME
    data = bytearray(file.read_bytes())
    if how == "truncate":
        data = data[: len(data) // 2]
    elif how == "bit-flip":
        data[len(data) - 100] ^= 0x04  # inside the last tensor's bytes: still a valid safetensors file
    elif how == "zero":
        data = bytearray(len(data))
    file.write_bytes(bytes(data))


def _write_nan_step(model: torch.nn.Module, root: Path, step: int) -> Path:
    """A step directory as publish_weights lays it out (manifest, STABLE) whose norm weight is NaN:
    what a publisher without the finiteness check would have written."""
    path = root / f"step_{step}"
    path.mkdir(parents=True)
    state = {k: v for k, v in _state(model).items() if k != "lm_head.weight"}
    state[NORM][3] = float("nan")
    save_file(state, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
    (path / "config.json").write_text(model.config.to_json_string())
    write_manifest(path)
    (path / "STABLE").write_text("{}")
    return path


# --- the trainer side -------------------------------------------------------------------------


def test_manifest_holds_the_sha256_of_every_published_file(tiny, tmp_path):
    path = _publish(tiny, tmp_path, step=1)
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert set(manifest["files"]) == {WEIGHTS_NAME, "config.json"}
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_or_inf_weights_are_never_published(tiny, tmp_path, bad):
    state = _state(tiny)
    state[NORM][5] = bad
    with pytest.raises(NonFiniteWeightsError, match=rf"step 4.*'{NORM}' has 1 non-finite"):
        publish_weights(state, tiny.config, tmp_path, step=4)
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temp directory


def test_overflow_in_the_publishing_cast_is_never_published(tiny, tmp_path):
    state = _state(tiny)
    state[NORM][0] = 1e6  # finite in float32, inf in float16
    with pytest.raises(NonFiniteWeightsError, match=NORM):
        publish_weights(state, tiny.config, tmp_path, step=2, dtype=torch.float16)


# --- loading ----------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["truncate", "bit-flip", "zero"])
def test_damaged_weights_file_is_refused_on_load(tiny, tmp_path, how):
    path = _publish(tiny, tmp_path, step=1)
    _corrupt(path, how)
    expected = "truncated" if how == "truncate" else "differ from the digest"
    with pytest.raises(IntegrityError, match=rf"{WEIGHTS_NAME}.*{expected}"):
        load_weights(path)


def test_truncated_file_is_refused_without_the_digest_pass(tiny, tmp_path):
    # The vLLM workers skip hashing (the middleware hashed just before) but still check sizes.
    path = _publish(tiny, tmp_path, step=1)
    _corrupt(path, "truncate")
    with pytest.raises(IntegrityError, match="truncated"):
        load_weights(path, verify_digests=False)


def test_missing_manifest_is_refused(tiny, tmp_path):
    path = _publish(tiny, tmp_path, step=1)
    (path / MANIFEST_NAME).unlink()
    with pytest.raises(IntegrityError, match=r"missing, so the files .* cannot be verified"):
        load_weights(path)


def test_manifest_that_does_not_list_the_weights_is_refused(tiny, tmp_path):
    path = _publish(tiny, tmp_path, step=1)
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    del manifest["files"][WEIGHTS_NAME]  # a manifest that verifies nothing must not pass
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(IntegrityError, match=f"{WEIGHTS_NAME}: not listed"):
        load_weights(path)


def test_nan_weights_on_disk_are_refused_on_load(tiny, tmp_path):
    path = _write_nan_step(tiny, tmp_path, step=3)
    with pytest.raises(NonFiniteWeightsError, match=rf"'{NORM}' has 1 non-finite"):
        load_weights(path)


def test_sharded_index_naming_a_file_outside_the_step_is_refused(tmp_path):
    path = tmp_path / "step_1"
    path.mkdir()
    (tmp_path / "secret.safetensors").write_bytes(b"elsewhere")
    (path / INDEX_NAME).write_text(json.dumps({"weight_map": {"w": "../secret.safetensors"}}))
    write_manifest(path)
    (path / "STABLE").write_text("{}")
    with pytest.raises(IntegrityError, match="plain file names"):
        load_weights(path)


# --- the hf server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny):
    """A server that has loaded step 1; yields (client, broadcast root)."""
    run = tmp_path_factory.mktemp("run")
    root = run / "broadcasts"
    _publish(tiny, root, step=1, shift=0.01)
    config = InferenceConfig(output_dir=run, max_model_len=64, num_threads=1)
    with running_server(config) as url, httpx.Client(base_url=url, timeout=120) as client:
        assert client.post("/update_weights", json={"path": "step_1"}).status_code == 200
        yield client, root


def _greedy(client: httpx.Client) -> list[int]:
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    return client.post("/v1/completions", json={**body, "return_token_ids": True}).json()["choices"][0][
        "token_ids"
    ]


def _refused_and_still_serving_step_1(client: httpx.Client, step: int, *needles: str) -> None:
    before = _greedy(client)
    response = client.post("/update_weights", json={"path": f"step_{step}"})
    assert response.status_code == 409, response.text
    message = response.json()["error"]["message"]
    assert all(n in message for n in needles), message
    assert client.get("/health").json()["weights"]["step"] == 1
    assert _greedy(client) == before  # the old weights, untouched


@pytest.mark.parametrize(("step", "how"), [(11, "truncate"), (12, "bit-flip"), (13, "zero")])
def test_server_refuses_damaged_weights_with_409(served, tiny, step, how):
    client, root = served
    _corrupt(_publish(tiny, root, step=step, shift=0.02), how)
    _refused_and_still_serving_step_1(client, step, f"step_{step}/{WEIGHTS_NAME}")


def test_server_refuses_nan_weights_with_409_naming_the_tensor(served, tiny):
    client, root = served
    _write_nan_step(tiny, root, step=14)
    _refused_and_still_serving_step_1(client, 14, NORM, "non-finite")


def test_server_refuses_weights_of_another_model_with_409(served):
    client, root = served
    publish_weights({"model.norm.weight": torch.ones(3)}, {}, root, step=15)
    _refused_and_still_serving_step_1(client, 15, "do not match the served model")


# --- the vLLM backend (middleware with a fake engine client, extension with a fake worker) ------


class _Engine:
    def __init__(self, results: list[Any]) -> None:
        self.results, self.calls = results, []

    async def pause_generation(self, *, mode: str = "abort") -> None:
        self.calls.append("pause")

    async def resume_generation(self) -> None:
        self.calls.append("resume")

    async def collective_rpc(self, method: str, args: tuple = (), **_: Any) -> list[Any]:
        self.calls.append("rpc")
        return self.results

    async def reset_prefix_cache(self) -> bool:
        self.calls.append("reset")
        return True


def _vllm_client(root: Path, engine: _Engine) -> TestClient:
    app = Starlette()
    app.state.engine_client = engine
    settings = {"broadcast_root": str(root), "secret_env": None, "served_model_name": "m"}
    app.add_middleware(AdminRoutesMiddleware, settings=settings)  # as vLLM adds it
    return TestClient(app)


@pytest.mark.parametrize("how", ["truncate", "bit-flip", "zero"])
def test_vllm_middleware_refuses_damaged_weights_before_pausing(tiny, tmp_path, how):
    root = tmp_path / "broadcasts"
    _corrupt(_publish(tiny, root, step=1), how)
    engine = _Engine([{"num_tensors": 1}])
    response = _vllm_client(root, engine).post("/update_weights", json={"path": "step_1"})
    assert response.status_code == 409 and WEIGHTS_NAME in response.json()["error"]["message"]
    assert engine.calls == []  # refused while vLLM kept serving: no pause, no worker call


def test_vllm_worker_refuses_nan_weights_and_the_middleware_answers_409(tiny, tmp_path):
    root = tmp_path / "broadcasts"
    path = _write_nan_step(tiny, root, step=2)

    class Worker(WeightUpdateExtension):
        def __init__(self) -> None:
            self.reloads = 0

        def reload_weights(self, **_: Any) -> None:
            self.reloads += 1

    worker = Worker()
    result = worker.prime_composer_load_weights(str(path))
    assert NORM in result["refused"] and worker.reloads == 0  # the model was never touched

    engine = _Engine([result, result])  # two tensor-parallel workers, both refusing
    response = _vllm_client(root, engine).post("/update_weights", json={"path": "step_2"})
    assert response.status_code == 409 and NORM in response.json()["error"]["message"]
    assert engine.calls == ["pause", "rpc", "resume"]  # no prefix-cache reset: nothing changed


def test_vllm_workers_that_disagree_are_a_500(tiny, tmp_path):
    root = tmp_path / "broadcasts"
    _publish(tiny, root, step=1)
    engine = _Engine([{"num_tensors": 3}, {"refused": "IntegrityError: truncated"}])
    response = _vllm_client(root, engine).post("/update_weights", json={"path": "step_1"})
    assert response.status_code == 500 and "disagree" in response.json()["error"]["message"]
    assert engine.calls[-1] == "resume"

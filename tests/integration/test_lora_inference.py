"""LoRA updates on the hf server: after ``/update_weights`` with a published adapter, the logprobs
the server returns equal a forward of the merged model (peft's ``merge_and_unload``, fp32,
max abs difference < 1e-4); a second adapter replaces the first instead of adding to it; an
adapter for layers the served model lacks is refused (409) and the served weights stay."""

from __future__ import annotations

import copy
from typing import Any

import httpx
import pytest
import torch

from prime_composer.config.base import ModelConfig
from prime_composer.config.inference import InferenceConfig
from prime_composer.config.trainer import LoraConfig
from prime_composer.inference.local import running_server
from prime_composer.trainer.lora import adapter_config, adapter_state_dict, apply_lora
from prime_composer.trainer.model import load_model
from prime_composer.transport.adapter import publish_adapter

MESSAGES = [{"role": "user", "content": "What is 12 + 30?"}]
TOL = 1e-4
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tmp_path_factory.mktemp("run")


@pytest.fixture(scope="module")
def client(run_dir: Any) -> Any:
    config = InferenceConfig(output_dir=run_dir, max_model_len=256, num_threads=1)
    with running_server(config) as url, httpx.Client(base_url=url, timeout=120) as c:
        yield c


def _lora_policy(seed: int) -> Any:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, _ = load_model(ModelConfig(name="builtin:tiny-qwen3", dtype="float32"), torch.device("cpu"))
    model = apply_lora(model, LoraConfig(rank=8, alpha=16.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # adapters as after training: B is not zero
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    return model.eval()


def _sample(client: httpx.Client) -> dict:
    body = {
        "messages": MESSAGES,
        "max_tokens": 16,
        "temperature": TEMPERATURE,
        "logprobs": True,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _max_error(model: torch.nn.Module, data: dict) -> float:
    prompt, choice = data["prompt_token_ids"], data["choices"][0]
    completion = choice["token_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
    ref = torch.log_softmax(logits / TEMPERATURE, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]
    served = torch.tensor([c["logprob"] for c in choice["logprobs"]["content"]])
    return (ref - served).abs().max().item()


@pytest.mark.slow
def test_served_logprobs_after_adapter_updates_match_the_merged_model(
    client: httpx.Client, run_dir: Any
) -> None:
    first, second = _lora_policy(seed=1), _lora_policy(seed=2)
    merged_first = copy.deepcopy(first).merge_and_unload()
    merged_second = copy.deepcopy(second).merge_and_unload()
    root = run_dir / "broadcasts"

    path = publish_adapter(adapter_state_dict(first), adapter_config(first), root, 1)
    response = client.post("/update_weights", json={"path": str(path)})
    assert response.status_code == 200, response.text
    assert _max_error(merged_first, _sample(client)) < TOL

    path = publish_adapter(adapter_state_dict(second), adapter_config(second), root, 2)
    assert client.post("/update_weights", json={"path": "step_2"}).status_code == 200
    after = _sample(client)
    assert _max_error(merged_second, after) < TOL  # replaced, not added to the first adapter
    assert _max_error(merged_first, after) > 1e-3

    # an adapter for a layer this model does not have is refused; step 2 is still served
    state = adapter_state_dict(second)
    key = next(iter(state))
    state[key.replace("layers.0.", "layers.99.")] = state.pop(key)
    state[key.replace("layers.0.", "layers.99.").replace("lora_A", "lora_B")] = state.pop(
        key.replace("lora_A", "lora_B")
    )
    publish_adapter(state, adapter_config(second), root, 3)
    refused = client.post("/update_weights", json={"path": "step_3"})
    assert refused.status_code == 409 and "layers.99" in refused.text, refused.text
    assert client.get("/health").json()["weights"]["step"] == 2
    assert _max_error(merged_second, _sample(client)) < TOL

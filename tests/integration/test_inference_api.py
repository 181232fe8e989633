"""The hf server's API contract over HTTP (uvicorn in-process on loopback, tiny model).

Clients are real peers where they exist: the ``openai`` SDK, ``renderers.client.generate`` and
verifiers' ``TrainClient`` (the exact code that calls ``/inference/v1/generate`` in training).
Logprobs are checked against a plain full forward of the same model, prompt ids against the
tokenizer's own ``apply_chat_template``.
"""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from prime_composer.config.inference import InferenceConfig
from prime_composer.inference.local import running_server
from prime_composer.model.resolve import resolve_model_name

MODEL = "builtin:tiny-qwen3"
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "What is 1 + 2?"},
]
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    path = resolve_model_name(MODEL)
    return (
        path,
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
        AutoTokenizer.from_pretrained(path),
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = InferenceConfig(output_dir=tmp_path_factory.mktemp("run"), max_model_len=256, num_threads=1)
    with running_server(config) as url:
        yield url


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server, timeout=120) as c:
        yield c


def _processed_logprobs(model, prompt_ids, completion_ids, temperature) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + completion_ids])).logits[0, len(prompt_ids) - 1 : -1]
    lp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return lp.gather(1, torch.tensor(completion_ids).unsqueeze(1)).squeeze(1).tolist()


def _max_abs(a, b) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_health_and_models(client):
    assert client.get("/health").json()["status"] == "ok"
    cards = client.get("/v1/models").json()["data"]
    assert [c["id"] for c in cards] == [MODEL] and cards[0]["max_model_len"] == 256


def test_chat_returns_token_ids_and_processed_logprobs(client, tiny):
    _, model, tokenizer = tiny
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 12,
        "temperature": 0.7,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 2,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    data = client.post("/v1/chat/completions", json=body).json()
    expected_prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    expected_prompt = expected_prompt["input_ids"] if hasattr(expected_prompt, "keys") else expected_prompt
    assert data["prompt_token_ids"] == list(expected_prompt)
    assert len(data["choices"]) == 2 and data["usage"]["completion_tokens"] == 24
    for choice in data["choices"]:
        ids = choice["token_ids"]
        content = choice["logprobs"]["content"]
        assert len(ids) == len(content) == 12 and choice["finish_reason"] == "length"
        assert choice["message"]["content"] == tokenizer.decode(ids, skip_special_tokens=True)
        ref = _processed_logprobs(model, data["prompt_token_ids"], ids, 0.7)
        assert _max_abs([c["logprob"] for c in content], ref) < TOL
        assert all(len(c["top_logprobs"]) == 2 for c in content)


def _stream_events(client, route: str, body: dict) -> list[str]:
    events = []
    with client.stream("POST", route, json={**body, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    return events[:-1]


def test_streamed_chat_equals_non_streamed_and_ends_with_usage_when_asked(client):
    body = {"messages": MESSAGES, "max_tokens": 10, "seed": 7, "return_token_ids": True, "ignore_eos": True}
    full = client.post("/v1/chat/completions", json=body).json()
    usage = {"stream_options": {"include_usage": True}}
    chunks = [json.loads(e) for e in _stream_events(client, "/v1/chat/completions", {**body, **usage})]
    assert chunks[0]["prompt_token_ids"] == full["prompt_token_ids"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
    deltas = [c["choices"][0] for c in chunks[1:-1]]
    assert "".join(d["delta"]["content"] for d in deltas) == full["choices"][0]["message"]["content"]
    assert [t for d in deltas for t in d["token_ids"]] == full["choices"][0]["token_ids"]
    assert deltas[-1]["finish_reason"] == "length"

    # Without include_usage (OpenAI's default) no chunk carries usage: the last one is the
    # final delta, and the tokens are the same.
    plain = [json.loads(e) for e in _stream_events(client, "/v1/chat/completions", body)]
    assert all("usage" not in c for c in plain)
    assert plain[-1]["choices"][0]["finish_reason"] == "length"
    assert [t for c in plain[1:] for t in c["choices"][0]["token_ids"]] == full["choices"][0]["token_ids"]


def test_streamed_completion_usage_only_when_asked(client):
    body = {"prompt": "Sort these letters", "max_tokens": 4, "ignore_eos": True}
    plain = [json.loads(e) for e in _stream_events(client, "/v1/completions", body)]
    assert all("usage" not in c and c["choices"] for c in plain)
    usage = {"stream_options": {"include_usage": True}}
    asked = [json.loads(e) for e in _stream_events(client, "/v1/completions", {**body, **usage})]
    assert asked[-1]["choices"] == [] and asked[-1]["usage"]["completion_tokens"] == 4
    # stream_options without a stream is refused, as OpenAI and vLLM do.
    response = client.post("/v1/completions", json={**body, **usage})
    assert response.status_code == 400 and "stream_options" in response.json()["error"]["message"]


def test_tokens_as_token_ids_and_stop_token(client):
    first = client.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "return_token_ids": True},
    ).json()["choices"][0]
    stop_id = first["token_ids"][2]  # greedy, so the same tokens come again
    expected = first["token_ids"][: first["token_ids"].index(stop_id) + 1]
    data = client.post(
        "/v1/chat/completions",
        json={
            "messages": MESSAGES,
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": True,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "stop_token_ids": [stop_id],
        },
    ).json()["choices"][0]
    assert data["token_ids"] == expected
    assert data["finish_reason"] == "stop" and data["stop_reason"] == stop_id
    assert [c["token"] for c in data["logprobs"]["content"]] == [f"token_id:{t}" for t in data["token_ids"]]


def test_completions_with_text_and_token_prompts(client, tiny):
    _, model, tokenizer = tiny
    prompt_ids = tokenizer.encode("What is 12 + 30?")
    common = {
        "n": 2,
        "max_tokens": 5,
        "logprobs": 1,
        "temperature": 1.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    data = client.post("/v1/completions", json={"prompt": [prompt_ids, [5, 6, 7]], **common}).json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    assert data["choices"][0]["prompt_token_ids"] == prompt_ids
    assert data["choices"][2]["prompt_token_ids"] == [5, 6, 7]
    text = client.post("/v1/completions", json={"prompt": "Sort these letters", **common}).json()
    assert text["choices"][1]["prompt_token_ids"] == tokenizer.encode("Sort these letters")
    for choice in data["choices"] + text["choices"]:
        ref = _processed_logprobs(model, choice["prompt_token_ids"], choice["token_ids"], 1.0)
        assert _max_abs(choice["logprobs"]["token_logprobs"], ref) < TOL
        assert choice["text"] == tokenizer.decode(choice["token_ids"], skip_special_tokens=True)


def test_stop_string(client):
    # Greedy continuation of this prompt by the tiny model: " of of of of ofhelpfulhelpful..."
    body = {"prompt": "Compute the sum of", "max_tokens": 8, "temperature": 0}
    text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert "help" in text[1:]
    data = client.post("/v1/completions", json={**body, "stop": ["zzz", "help"]}).json()["choices"][0]
    assert data["text"] == text[: text.index("help")]
    assert data["finish_reason"] == "stop" and data["stop_reason"] == "help"


def test_openai_sdk_client(server):
    from openai import OpenAI

    sdk = OpenAI(base_url=f"{server}/v1", api_key="unused")
    response = sdk.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True, extra_body={"return_token_ids": True}
    )
    choice = response.choices[0]
    assert (
        len(choice.logprobs.content)
        == len(choice.model_extra["token_ids"])
        == response.usage.completion_tokens
    )
    stream = sdk.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, stream=True))
    assert all(c.usage is None for c in chunks) and chunks[-1].choices[0].finish_reason is not None


def test_renderers_generate_contract(server, tiny):
    """The token-in endpoint as ``renderers`` (verifiers' training path) calls and parses it."""
    from openai import AsyncOpenAI
    from renderers import create_renderer
    from renderers.base import load_tokenizer
    from renderers.client import generate

    path, model, _ = tiny
    renderer = create_renderer(load_tokenizer(path))

    async def call():
        client = AsyncOpenAI(base_url=f"{server}/v1", api_key="unused")
        try:
            return await generate(
                client=client,
                renderer=renderer,
                messages=MESSAGES,
                model=MODEL,
                sampling_params={"temperature": 0.9, "max_tokens": 8},
            )
        finally:
            await client.close()

    result = asyncio.run(call())
    assert 1 <= len(result["completion_ids"]) <= 8
    ref = _processed_logprobs(model, result["prompt_ids"], result["completion_ids"], 0.9)
    assert _max_abs(result["completion_logprobs"], ref) < TOL


def test_verifiers_train_client(server, tiny, monkeypatch):
    from verifiers.v1.clients.train import TrainClient
    from verifiers.v1.configs.client import TrainClientConfig
    from verifiers.v1.dialects.chat import ChatDialect
    from verifiers.v1.types import SamplingConfig

    path, model, _ = tiny
    monkeypatch.setenv("PC_TEST_API_KEY", "unused")
    config = TrainClientConfig(
        base_url=f"{server}/v1", api_key_var="PC_TEST_API_KEY", renderer_model_name=path
    )

    async def call():
        client = TrainClient(config)
        try:
            return await client.get_response(
                ChatDialect(),
                {"model": MODEL, "messages": MESSAGES},
                SamplingConfig(temperature=1.0, max_tokens=6),
            )
        finally:
            await client.close()

    response = asyncio.run(call())
    tokens = response.tokens
    assert 1 <= len(tokens.completion_ids) <= 6
    ref = _processed_logprobs(model, list(tokens.prompt_ids), list(tokens.completion_ids), 1.0)
    assert _max_abs(tokens.completion_logprobs, ref) < TOL

"""Weight updates, the shared secret and bad input on the hf server (uvicorn in-process, tiny model).

The server has a secret, so every request but ``/health`` carries it (the ``client`` fixture does).

The round trip is the trainer -> server contract: a "trainer" model takes an optimizer step,
publishes with ``publish_weights``, the server loads it through ``/update_weights``, and the
logprobs the server returns must equal the trainer model's own ``log_softmax(logits / T)`` over
the same tokens (max abs difference < 1e-4, fp32).
"""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from prime_composer.config.inference import InferenceConfig
from prime_composer.inference.local import running_server
from prime_composer.model.resolve import resolve_model_name
from prime_composer.transport.weights import publish_weights

SECRET_ENV = "PC_TEST_INFERENCE_SECRET"
SECRET = "test-secret-3f9a"
AUTH = {"Authorization": f"Bearer {SECRET}"}
MESSAGES = [{"role": "user", "content": "What is 12 + 30?"}]
TOL = 1e-4


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("run")


@pytest.fixture(scope="module")
def server(run_dir):
    os.environ[SECRET_ENV] = SECRET
    config = InferenceConfig(output_dir=run_dir, secret_env=SECRET_ENV, max_model_len=256, num_threads=1)
    try:
        with running_server(config) as url:
            yield url
    finally:
        os.environ.pop(SECRET_ENV, None)


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server, timeout=120, headers=AUTH) as c:
        yield c


@pytest.fixture(scope="module")
def trainer_model():
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(resolve_model_name("builtin:tiny-qwen3"), dtype=torch.float32)


def _sample(client, temperature: float) -> dict:
    body = {
        "messages": MESSAGES,
        "max_tokens": 16,
        "temperature": temperature,
        "logprobs": True,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _max_error(model, data: dict, temperature: float) -> float:
    prompt, choice = data["prompt_token_ids"], data["choices"][0]
    completion = choice["token_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
    ref = (
        torch.log_softmax(logits / temperature, -1)
        .gather(1, torch.tensor(completion).unsqueeze(1))
        .squeeze(1)
    )
    served = torch.tensor([c["logprob"] for c in choice["logprobs"]["content"]])
    return (ref - served).abs().max().item()


def test_weight_round_trip_matches_trainer_logprobs(client, trainer_model, run_dir):
    model = trainer_model
    base = {k: v.clone() for k, v in model.state_dict().items()}
    assert _max_error(model, _sample(client, 0.8), 0.8) < TOL  # same weights before any update

    # One real optimizer step, as the trainer would take.
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batch = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    model(batch, labels=batch).loss.backward()
    optimizer.step()
    model.eval()

    path = publish_weights(model, model.config, run_dir / "broadcasts", step=1)
    response = client.post("/update_weights", json={"path": str(path)})
    assert response.status_code == 200, response.text
    assert response.json()["step"] == 1 and client.get("/health").json()["weights"]["step"] == 1

    after = _sample(client, 0.8)
    assert _max_error(model, after, 0.8) < TOL
    base_model = type(model)(model.config).eval()
    base_model.load_state_dict(base)
    assert _max_error(base_model, after, 0.8) > 1e-3  # the server really serves the new weights

    # relative path under the broadcast root works too; reload returns to the base weights
    assert client.post("/update_weights", json={"path": "step_1"}).status_code == 200
    assert client.post("/reload_weights").status_code == 200
    assert _max_error(base_model, _sample(client, 1.0), 1.0) < TOL


def test_weight_path_checks(client, run_dir, tmp_path, trainer_model):
    root = run_dir / "broadcasts"
    outside = publish_weights(trainer_model, trainer_model.config, tmp_path / "elsewhere", step=2)
    (root / "step_9").mkdir(parents=True, exist_ok=True)  # no STABLE: still being written
    escape = root / "step_666"
    if not escape.exists():
        escape.symlink_to(outside)
    cases = [
        ({"path": str(outside)}, 403, "outside the broadcast root"),
        ({"path": "../../etc"}, 403, "outside the broadcast root"),
        ({"path": str(escape)}, 403, "outside the broadcast root"),  # symlink out of the root
        ({"path": str(root)}, 403, "outside the broadcast root"),
        ({"path": str(root / "step_404")}, 404, "does not exist"),
        ({"path": str(root / "step_9")}, 409, "STABLE"),
        ({"dir": "step_1"}, 400, "path"),
    ]
    for body, status, message in cases:
        response = client.post("/update_weights", json=body)
        assert response.status_code == status, (body, response.text)
        assert message in response.json()["error"]["message"]


def test_every_route_but_health_needs_the_secret(server):
    routes = [
        ("POST", "/update_weights", {"path": "step_1"}),
        ("POST", "/reload_weights", None),
        ("POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
        ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("POST", "/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}),
        ("GET", "/v1/models", None),
        ("GET", "/openapi.json", None),
    ]
    with httpx.Client(base_url=server, timeout=120) as anonymous:
        for method, route, body in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": SECRET}):
                response = anonymous.request(method, route, json=body, headers=headers)
                assert response.status_code == 401, (route, headers, response.text)
                assert SECRET not in response.text
        assert anonymous.get("/health").status_code == 200  # the launcher polls it without one
        assert anonymous.get("/v1/models", headers=AUTH).status_code == 200


def test_burst_of_bad_requests_mixed_with_good_ones(server):
    too_long = {"messages": MESSAGES, "max_tokens": 1000}
    bad = [
        ("/v1/chat/completions", b'{"messages": [', 400, "not valid JSON"),
        ("/v1/chat/completions", {"model": "gpt-5", "messages": MESSAGES}, 404, "does not exist"),
        ("/v1/chat/completions", too_long, 400, "maximum context length is 256"),
        ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
        ("/v1/chat/completions", {"messages": MESSAGES, "top_k": 5}, 400, "top_k"),
        ("/v1/chat/completions", {"messages": MESSAGES, "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": [1, 2, 99999]}, 400, "invalid prompt token ids"),
        (
            "/inference/v1/generate",
            {"token_ids": [-3], "sampling_params": {}},
            400,
            "invalid prompt token ids",
        ),
        ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"bogus": 1}}, 400, "bogus"),
        ("/update_weights", {"path": "/etc"}, 403, "outside the broadcast root"),
        ("/update_weights", b"not json", 400, "not valid JSON"),
        ("/v1/chat/completions (no secret)", {"messages": MESSAGES}, 401, "missing shared secret"),
    ]
    good = {"messages": MESSAGES, "max_tokens": 8, "ignore_eos": True}

    async def send(client, endpoint, body):
        endpoint, anonymous, _ = endpoint.partition(" (no secret)")
        headers = {} if anonymous else dict(AUTH)
        if isinstance(body, bytes):
            headers["content-type"] = "application/json"
            return await client.post(endpoint, content=body, headers=headers)
        return await client.post(endpoint, json=body, headers=headers)

    async def main():
        async with httpx.AsyncClient(base_url=server, timeout=120) as client:
            bad_calls = [send(client, e, b) for e, b, _, _ in bad] * 2
            good_calls = [send(client, "/v1/chat/completions", good) for _ in range(8)]
            results = await asyncio.gather(*good_calls, *bad_calls)
            after = await send(client, "/v1/chat/completions", good)  # still serving
            return results[:8], results[8:], after

    good_results, bad_results, after = asyncio.run(main())
    for response in good_results:
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8
    for response, (endpoint, _, status, message) in zip(bad_results, bad * 2, strict=True):
        assert response.status_code == status, (endpoint, response.text)
        error = response.json()["error"]
        assert message in error["message"] and error["code"] == status
    assert after.status_code == 200

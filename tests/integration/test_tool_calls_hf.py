"""Tool calls through the hf server over HTTP, with the official ``openai`` client.

Two servers on 127.0.0.1:

- a scripted one: the real app, chat template and detokenizer, but the decode loop replaced by one
  that writes a chosen reply token by token. It pins the server's reading of replies (calls,
  prose, malformed and cut calls, ``tool_choice``, streaming) on exact texts;
- the tiny model fine-tuned to call tools (``tool_call_model``): real generation through the real
  template, a multi-turn conversation with a tool result, and ``tool_choice`` forcing a call.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from openai import OpenAI
from tool_call_model import ANSWER, BOTH, OSLO, PARIS, REPLIES, TOOLS, call_text, prompt_ids, tool_caller_dir

from prime_composer.config.inference import InferenceConfig
from prime_composer.inference.hf.detokenize import IncrementalDetokenizer
from prime_composer.inference.hf.server import create_app
from prime_composer.inference.local import running_app, running_server
from prime_composer.inference.openai_routes import ServingState
from prime_composer.inference.requests import ChoiceUpdate, GenerationRequest
from prime_composer.model.resolve import resolve_model_name

MODEL = "builtin:tiny-qwen3"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the web"}}
PARIS_CALL = call_text({"city": "Paris"})
ROME_CALL = call_text({"city": "Rome"})
BAD_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>'
SCRIPTS = {
    "prose": "Just prose, no calls.",
    "one": f"Let me check.\n{PARIS_CALL}",
    "two": f"Checking both.\n{PARIS_CALL}\n{ROME_CALL}",
    "malformed": f"{PARIS_CALL}\n{BAD_CALL}",
    # Continuations of a forced opening (tool_choice required / named).
    "required": '{"name": "search", "arguments": {"q": "tides"}}\n</tool_call>',
    "named": ' {"city": "Oslo"}}\n</tool_call>',
}
"""Reply by the word the last user message is."""


class ScriptedEngine:
    """The decode loop's interface, replying ``SCRIPTS[<last user message>]`` one token per update
    through the real incremental detokenizer (``max_tokens`` cuts it, as the real loop does)."""

    def __init__(self, tokenizer: Any, max_model_len: int = 2048) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def check_request(self, request: GenerationRequest) -> None:
        pass

    async def generate(self, request: GenerationRequest) -> AsyncIterator[list[ChoiceUpdate]]:
        prompt = self.tokenizer.decode(request.prompt_ids)
        word = prompt.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        ids = [*self.tokenizer.encode(SCRIPTS[word], add_special_tokens=False), self.tokenizer.eos_token_id]
        ids = ids[: request.params.max_tokens]
        detoks = [
            IncrementalDetokenizer(self.tokenizer, request.prompt_ids, True) for _ in range(request.params.n)
        ]
        for position, token in enumerate(ids):
            last = position == len(ids) - 1
            finish = ("stop" if token == self.tokenizer.eos_token_id else "length") if last else None
            updates = []
            for index, detok in enumerate(detoks):
                detok.add(token)
                if last:
                    detok.flush()
                text = detok.take_delta(final=last)
                updates.append(ChoiceUpdate(index, [token], [-0.5], [[]], text, finish))
            yield updates
            await asyncio.sleep(0)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory) -> Iterator[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_name(MODEL))
    state = ServingState(
        engine=ScriptedEngine(tokenizer),  # type: ignore[arg-type]
        tokenizer=tokenizer,
        served_model_name=MODEL,
        model_root=MODEL,
    )
    with running_app(create_app(state, tmp_path_factory.mktemp("run"), None)) as url:
        yield url


def _sdk(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _ask(word: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": word}],
        "tools": [WEATHER, SEARCH],
        **extra,
    }


def _calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _metrics(url: str) -> dict[str, float]:
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return {k: float(v) for k, v in (line.split() for line in lines if not line.startswith("#"))}


def test_parallel_calls_and_prose_with_the_openai_client(scripted: str) -> None:
    response = _sdk(scripted).chat.completions.create(**_ask("two"))
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking both."
    assert _calls(choice.message) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    ids = [c.id for c in choice.message.tool_calls or []]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    assert choice.model_extra is not None and choice.model_extra["num_malformed_tool_calls"] == 0

    only_calls = _sdk(scripted).chat.completions.create(**_ask("two", parallel_tool_calls=False))
    assert only_calls.choices[0].message.content == "Checking both."  # OpenAI: content null only when empty
    assert _calls(only_calls.choices[0].message) == [("get_weather", {"city": "Paris"})]  # the first only

    prose = _sdk(scripted).chat.completions.create(**_ask("prose")).choices[0]
    assert prose.message.content == "Just prose, no calls." and prose.message.tool_calls is None
    assert prose.finish_reason == "stop"


def _raw_stream(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


@pytest.mark.parametrize("word", ["one", "two", "malformed", "prose"])
def test_a_streamed_reply_adds_up_to_the_non_streamed_one(scripted: str, word: str) -> None:
    sdk = _sdk(scripted)
    full = sdk.chat.completions.create(**_ask(word)).choices[0]
    with sdk.chat.completions.stream(**_ask(word)) as stream:  # the SDK's own accumulation
        streamed = stream.get_final_completion().choices[0]
    assert (streamed.message.content or None) == full.message.content
    assert _calls(streamed.message) == _calls(full.message)
    assert streamed.finish_reason == full.finish_reason

    body = {**_ask(word), "return_token_ids": True}
    full_ids = httpx.post(f"{scripted}/v1/chat/completions", json=body).json()["choices"][0]["token_ids"]
    chunks = _raw_stream(scripted, body)
    deltas = [c["choices"][0] for c in chunks[1:]]
    assert sum(d["finish_reason"] is not None for d in deltas) == 1 and deltas[-1]["finish_reason"]
    assert deltas[-1]["num_malformed_tool_calls"] == full.model_extra["num_malformed_tool_calls"]
    call_deltas = [t for d in deltas for t in d["delta"].get("tool_calls", [])]
    for index in range(len(full.message.tool_calls or [])):
        first, *rest = [t for t in call_deltas if t["index"] == index]
        assert first["id"].startswith("call_") and first["type"] == "function"
        assert first["function"] == {"name": "get_weather", "arguments": ""}  # id and name first
        assert (
            "".join(t["function"]["arguments"] for t in rest)
            == full.message.tool_calls[index].function.arguments
        )
    assert [t for d in deltas for t in d["token_ids"]] == full_ids


def test_malformed_call_is_content_and_counted(scripted: str) -> None:
    before = _metrics(scripted)
    choice = _sdk(scripted).chat.completions.create(**_ask("malformed")).choices[0]
    assert _calls(choice.message) == [("get_weather", {"city": "Paris"})]  # its neighbour still counts
    assert choice.message.content == BAD_CALL and choice.finish_reason == "tool_calls"
    assert choice.model_extra is not None and choice.model_extra["num_malformed_tool_calls"] == 1
    after = _metrics(scripted)
    assert (
        after["prime_composer_tool_calls_malformed_total"]
        - before["prime_composer_tool_calls_malformed_total"]
        == 1
    )
    assert after["prime_composer_tool_calls_total"] - before["prime_composer_tool_calls_total"] == 1
    assert (
        after["prime_composer_tool_call_replies_total"] - before["prime_composer_tool_call_replies_total"]
        == 1
    )


def test_a_call_cut_by_max_tokens_is_malformed_and_finishes_by_length(scripted: str) -> None:
    # 13 tokens of prose and newline, 10 of "<tool_call>", then the call's body.
    choice = _sdk(scripted).chat.completions.create(**_ask("one", max_tokens=30)).choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content.startswith("Let me check.\n<tool_call>\n{")
    assert choice.model_extra is not None and choice.model_extra["num_malformed_tool_calls"] == 1
    # Cut inside the opening marker: not a call yet, the text is content, nothing malformed.
    choice = _sdk(scripted).chat.completions.create(**_ask("one", max_tokens=18)).choices[0]
    assert choice.message.content == "Let me check.\n<tool"
    assert choice.model_extra is not None and choice.model_extra["num_malformed_tool_calls"] == 0


def test_tool_choice_none_renders_the_tools_and_returns_the_text_as_it_is(scripted: str) -> None:
    response = httpx.post(
        f"{scripted}/v1/chat/completions", json={**_ask("one", tool_choice="none"), "return_token_ids": True}
    ).json()
    choice = response["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": SCRIPTS["one"]}
    assert choice["finish_reason"] == "stop" and "num_malformed_tool_calls" not in choice
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_name(MODEL))
    assert '"name": "search"' in tokenizer.decode(response["prompt_token_ids"])


def test_required_and_named_start_the_reply_with_a_call(scripted: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_name(MODEL))
    for word, tool_choice, opening, call, finish in [
        ("required", "required", "<tool_call>\n", ("search", {"q": "tides"}), "tool_calls"),
        (
            "named",
            {"type": "function", "function": {"name": "get_weather"}},
            '<tool_call>\n{"name": "get_weather", "arguments":',
            ("get_weather", {"city": "Oslo"}),
            "stop",  # OpenAI's finish reason for a named call
        ),
    ]:
        body = {**_ask(word, tool_choice=tool_choice), "return_token_ids": True}
        data = httpx.post(f"{scripted}/v1/chat/completions", json=body).json()
        choice = data["choices"][0]
        prompt = data["prompt_token_ids"]
        # The opening was not sampled: it ends the prompt, the completion is the sampled tokens only.
        plain = httpx.post(f"{scripted}/v1/chat/completions", json={**_ask(word), "return_token_ids": True})
        plain_prompt = plain.json()["prompt_token_ids"]
        assert prompt[: len(plain_prompt)] == plain_prompt
        assert tokenizer.decode(prompt[len(plain_prompt) :]) == opening
        assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == SCRIPTS[word]
        calls = [
            (c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in choice["message"]["tool_calls"]
        ]
        assert calls == [call] and choice["message"]["content"] is None and choice["finish_reason"] == finish
        streamed = _raw_stream(scripted, body)
        assert streamed[-1]["choices"][0]["finish_reason"] == finish


def test_a_call_of_a_tool_not_offered_is_content_flagged_and_counted(scripted: str) -> None:
    before = _metrics(scripted)
    body = {**_ask("two"), "tools": [SEARCH]}  # the script calls get_weather twice
    choice = _sdk(scripted).chat.completions.create(**body).choices[0]
    assert choice.message.tool_calls is None
    assert choice.message.content == f"Checking both.\n{PARIS_CALL}\n{ROME_CALL}"
    assert choice.finish_reason == "unknown_tool_call" and choice.model_extra["num_unknown_tool_calls"] == 2
    after = _metrics(scripted)
    assert (
        after["prime_composer_tool_calls_unknown_total"]
        == before["prime_composer_tool_calls_unknown_total"] + 2
    )
    assert after["prime_composer_tool_calls_total"] == before["prime_composer_tool_calls_total"]
    # Streamed: the same content and finish reason, no tool_calls delta.
    deltas = [c["choices"][0] for c in _raw_stream(scripted, {**body, "stream": True}) if c.get("choices")]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == choice.message.content
    assert not any(d["delta"].get("tool_calls") for d in deltas)
    assert deltas[-1]["finish_reason"] == "unknown_tool_call" and deltas[-1]["num_unknown_tool_calls"] == 2


# ----------------------------------------------------------------------- the fine-tuned model


@pytest.fixture(scope="module")
def caller(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    torch.set_num_threads(1)
    path = tool_caller_dir()
    config = InferenceConfig(
        output_dir=tmp_path_factory.mktemp("run"),
        model={"name": str(path)},
        max_model_len=1024,
        num_threads=1,
    )
    with running_server(config) as url:
        yield url, path


def _create(url: str, path: Path, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return _sdk(url).chat.completions.create(
        model=str(path),
        messages=messages,
        tools=TOOLS,
        temperature=0,
        max_tokens=200,
        extra_body={"return_token_ids": True},
        **extra,
    )


def test_the_model_calls_tools_through_template_and_generation(caller: tuple[str, Path]) -> None:
    from transformers import AutoTokenizer

    url, path = caller
    tokenizer = AutoTokenizer.from_pretrained(path)
    single = _create(url, path, PARIS)
    choice = single.choices[0]
    assert _calls(choice.message) == [("get_weather", {"city": "Paris"})]
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    # The prompt is the template's rendering of the tools (in vLLM's form) and the conversation.
    assert single.model_extra["prompt_token_ids"] == prompt_ids(tokenizer, PARIS)
    assert tokenizer.decode(choice.model_extra["token_ids"], skip_special_tokens=True) == REPLIES[0][1]

    parallel = _create(url, path, BOTH).choices[0]
    assert _calls(parallel.message) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    with _sdk(url).chat.completions.stream(
        model=str(path), messages=BOTH, tools=TOOLS, temperature=0, max_tokens=200
    ) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert _calls(streamed.message) == _calls(parallel.message) and streamed.finish_reason == "tool_calls"

    malformed = _create(url, path, OSLO).choices[0]
    assert malformed.message.tool_calls is None and malformed.message.content == REPLIES[2][1]
    assert malformed.model_extra["num_malformed_tool_calls"] == 1 and malformed.finish_reason == "stop"


def test_a_tool_result_comes_back_through_the_template(caller: tuple[str, Path]) -> None:
    """The assistant's earlier call (arguments as JSON text, content null, as OpenAI clients send
    them) and the tool's result render as the template renders them: the model answers."""
    from transformers import AutoTokenizer

    url, path = caller
    response = _create(url, path, ANSWER)
    assert response.model_extra["prompt_token_ids"] == prompt_ids(AutoTokenizer.from_pretrained(path), ANSWER)
    choice = response.choices[0]
    assert choice.message.content == "It is sunny." and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"


def test_named_tool_choice_forces_the_call_on_the_model(caller: tuple[str, Path]) -> None:
    url, path = caller
    named = {"type": "function", "function": {"name": "get_weather"}}
    # The model answers ANSWER with prose; forced, the reply starts a get_weather call and the rest
    # is decoded under the call grammar: a get_weather call with JSON object arguments, always.
    forced = _create(url, path, ANSWER, tool_choice=named).choices[0]
    assert [c.function.name for c in forced.message.tool_calls] == ["get_weather"], forced
    assert isinstance(json.loads(forced.message.tool_calls[0].function.arguments), dict)
    assert forced.model_extra["num_malformed_tool_calls"] == 0 and forced.finish_reason == "stop"
    # On PARIS the forced opening is where the model's own call starts: it completes it.
    agreed = _create(url, path, PARIS, tool_choice=named).choices[0]
    assert _calls(agreed.message) == [("get_weather", {"city": "Paris"})] and agreed.finish_reason == "stop"

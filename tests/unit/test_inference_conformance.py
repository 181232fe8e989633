"""OpenAI's request rules (``conformance``), the forced-call grammar (``call_grammar``), its token
masks (``hf.constrain``) and the vLLM reply filter (``vllm.chat_checks``), without a server."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import pytest

from prime_composer.inference.call_grammar import CallGrammar, CallSpec
from prime_composer.inference.conformance import (
    IGNORED_FIELDS,
    check_chat_body,
    check_schema,
    check_tool_messages,
    check_tools,
    unknown_fields_error,
)
from prime_composer.inference.guard import APIError
from prime_composer.inference.vllm.chat_checks import ReplyFilter, UnknownCallStats, bind_forced_arguments

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "unit": {"enum": ["c", "f"]},
        "tags": {"type": "array", "items": {"type": "number"}},
        "exact": {"type": "boolean"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
CLOSE = "\n</tool_call>"


def _tool(name: str, parameters: Any = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def _refused(fn: Any, *args: Any) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args)
    assert info.value.status == 400
    return info.value


# ----------------------------------------------------------------------------- requests


@pytest.mark.parametrize(
    ("tools", "param", "needle"),
    [
        ([_tool("get weather")], "tools[0].function.name", "not a valid function name"),
        ([_tool("rm;ls")], "tools[0].function.name", "not a valid function name"),
        ([_tool("x" * 65)], "tools[0].function.name", "1 to 64"),
        ([_tool("a"), _tool("b"), _tool("a")], "tools[2].function.name", "already the name of tools[0]"),
        ([_tool("f", {"type": 42})], "tools[0].function.parameters.type", "type must be one of"),
        (
            [_tool("f", {"type": "object", "properties": []})],
            "tools[0].function.parameters.properties",
            "object",
        ),
        (
            [_tool("f", {"type": "object", "properties": {"a": {"type": "strin"}}})],
            "tools[0].function.parameters.properties.a.type",
            "type must be one of",
        ),
        (
            [_tool("f", {"type": "object", "required": ["a", "a"]})],
            "tools[0].function.parameters.required",
            "unique",
        ),
        ([_tool("f", {"type": "string"})], "tools[0].function.parameters", '"type": "object"'),
        ([_tool("f", {"type": "object", "properties": {"a": {"pattern": "("}}})], None, "regular expression"),
        ([_tool("f", {"type": "object", "properties": {"a": {"maxLength": -1}}})], None, "non-negative"),
        ([_tool("f", {"anyOf": []})], "tools[0].function.parameters.anyOf", "non-empty"),
    ],
)
def test_bad_tools_are_refused_naming_the_field(tools: list[Any], param: str | None, needle: str) -> None:
    error = _refused(check_tools, tools)
    assert needle in error.message
    if param is not None:
        assert error.param == param and error.message.startswith(param)


def test_good_tools_pass() -> None:
    check_tools(
        [_tool("get_weather", WEATHER_SCHEMA), _tool("search-2"), _tool("A" * 64, {"type": "object"})]
    )
    check_schema({"type": ["string", "null"], "items": [{"type": "string"}], "x-vendor": 42}, "p")
    check_schema(True, "p")


def _assistant(*ids: str) -> dict[str, Any]:
    calls = [{"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ids]
    return {"role": "assistant", "content": None, "tool_calls": calls}


def _answer(call_id: Any) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": "ok"}


USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("messages", "param", "needle"),
    [
        (
            [USER, _assistant("c1"), _answer("c2")],
            "messages[2].tool_call_id",
            "matches no call of messages[1]",
        ),
        ([USER, _assistant("c1"), USER], "messages[1].tool_calls", "no answer to ['c1']"),
        ([USER, _assistant("c1", "c2"), _answer("c1")], "messages[1].tool_calls", "no answer to ['c2']"),
        ([USER, _answer("c1")], "messages[1]", "none is open"),
        (
            [USER, _assistant("c1"), _answer("c1"), _answer("c1")],
            "messages[3].tool_call_id",
            "already answered",
        ),
        ([USER, _assistant("c1"), _answer(None)], "messages[2].tool_call_id", "id of the call"),
        ([USER, _assistant("c1", "c1")], "messages[1].tool_calls[1].id", "another call"),
        ([USER, _assistant("")], "messages[1].tool_calls[0].id", "needs an id"),
        # An answer after the conversation moved on answers nothing.
        ([USER, _assistant("c1"), _answer("c1"), USER, _answer("c1")], "messages[4]", "none is open"),
    ],
)
def test_tool_messages_must_answer_calls(messages: list[Any], param: str, needle: str) -> None:
    error = _refused(check_tool_messages, messages)
    assert error.param == param and needle in error.message


def test_answered_calls_pass() -> None:
    check_tool_messages(
        [
            USER,
            _assistant("c1", "c2"),
            _answer("c2"),
            _answer("c1"),
            {"role": "assistant", "content": "done"},
            USER,
        ]
    )
    check_tool_messages([USER, {"role": "assistant", "content": "x", "tool_calls": []}, USER])


def test_unknown_fields_are_refused_and_the_ignored_ones_listed() -> None:
    for name, needle in [
        ("functions", "tools"),
        ("function_call", "tool_choice"),
        ("reasoning_effort", "not"),
    ]:
        error = unknown_fields_error({name: "x"}, ["messages"])
        assert error is not None and error.param == name and needle in error.message
    error = unknown_fields_error({"messages": [], "frobnicate": 1}, ["messages"])
    assert error is not None and error.param == "frobnicate" and "metadata" in error.message
    assert unknown_fields_error({"messages": [], **dict.fromkeys(IGNORED_FIELDS, "x")}, ["messages"]) is None
    assert unknown_fields_error({"reasoning_effort": None}, []) is None  # null: unset
    with pytest.raises(APIError):
        check_chat_body({"messages": [USER], "tools": [_tool("a b")]}, None)
    check_chat_body({"messages": [USER], "frobnicate": 1}, None)  # fields left to the backend


# ----------------------------------------------------------------------------- the grammar


def _named() -> CallGrammar:
    return CallGrammar({"get_weather": WEATHER_SCHEMA}, named=True, close=CLOSE)


def _complete(grammar: CallGrammar, text: str) -> bool:
    state = grammar.feed(grammar.start, text)
    return state is not None and grammar.done(state)


def _alive(grammar: CallGrammar, text: str) -> bool:
    return grammar.feed(grammar.start, text) is not None


def test_named_grammar_accepts_valid_arguments_only() -> None:
    g = _named()
    assert _complete(g, ' {"city": "Paris", "days": 3}}' + CLOSE)
    assert _complete(
        g, ' {"days": -0, "city": "Pa\\"r\\u00e9s", "tags": [1.5, -2e3, 0], "unit": "f"}}' + CLOSE
    )
    assert _complete(g, '{"city":"x","days":1,"exact":false}}' + CLOSE)
    for dead in [
        ' {"days": 3}',  # a required key missing at the close
        ' {"city": 1',  # a number where a string is
        ' {"city": "a", "city"',  # a key twice
        ' {"town"',  # not a property (additionalProperties false)
        ' {"city": "a", "days": 3.5',  # an integer with a fraction
        ' {"unit": "x',  # not in the enum
        ' {"tags": [1,]',  # a trailing comma
        ' {"city": "a\x01',  # a control character in a string
        ' {"city": "\\q',  # a bad escape
        ' {"days": 01',  # a leading zero
        ' {"days": NaN',
        "      {",  # more whitespace than MAX_WHITESPACE
        ' {"city": "a", "days": 1}} ',  # anything but the close after the call
        ' {"city": "a", "days": 1, "unit": "c", "tags": [], "exact": true,',  # no key is left
    ]:
        assert not _alive(g, dead), dead
    assert _alive(g, ' {"days": 3') and not _complete(g, ' {"city": "a", "days": 1}')


def test_required_grammar_names_an_offered_tool() -> None:
    g = CallGrammar(
        {"a": None, "ab": {"type": "object", "properties": {"x": {"type": "boolean"}}}},
        named=False,
        close=CLOSE,
    )
    assert _complete(g, '{"name": "ab", "arguments": {"x": true, "y": [null, {"z": "w"}]}}' + CLOSE)
    assert _complete(g, '{"name": "a", "arguments": {}}' + CLOSE)
    assert not _alive(g, '{"name": "ab", "arguments": {"x": 1')
    assert not _alive(g, '{"name": "c')


def _schema_holds(value: Any, schema: dict[str, Any]) -> bool:
    """A small independent checker of what the grammar promises (the subset it implements)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        if not isinstance(value, dict) or not set(schema.get("required", [])) <= set(value):
            return False
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False and not set(value) <= set(props):
            return False
        return all(_schema_holds(v, props.get(k, {})) for k, v in value.items())
    if kind == "array":
        return isinstance(value, list) and all(_schema_holds(v, schema.get("items", {})) for v in value)
    checks = {
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
    }
    return checks.get(kind, lambda v: True)(value)


@pytest.mark.slow
def test_random_walks_end_in_schema_valid_json() -> None:
    """Walk the automaton choosing random allowed characters; every completed walk is JSON that
    ``json.loads`` reads and the independent checker accepts."""
    g = _named()
    alphabet = sorted({*'{}[]":,.-+eE0123456789 \n\\tfnrulasycidpgx', "é", *CLOSE})
    rng = random.Random(0)
    completed = 0
    for _ in range(300):
        state, text = g.start, ""
        for _ in range(300):
            options = [c for c in alphabet if g.step(state, c) is not None]
            if not options:
                break
            # Favour structure so that walks finish: closing characters first when allowed.
            closing = [c for c in options if c in '}"]' or c in CLOSE]
            char = rng.choice(closing if closing and rng.random() < 0.3 else options)
            state, text = g.step(state, char), text + char
            if g.done(state):
                break
        if g.done(state):
            completed += 1
            assert text.endswith("}" + CLOSE)
            arguments = json.loads(text[: -len("}" + CLOSE)])
            assert _schema_holds(arguments, WEATHER_SCHEMA), text
    assert completed >= 20


# ----------------------------------------------------------------------------- token masks


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from prime_composer.model.resolve import resolve_model_name

    return AutoTokenizer.from_pretrained(resolve_model_name("builtin:tiny-qwen3"))


def test_masks_are_exactly_the_tokens_the_automaton_accepts(tokenizer: Any) -> None:
    from prime_composer.inference.hf.constrain import CallConstraint, ConstraintCache

    cache = ConstraintCache(tokenizer, len(tokenizer) + 3)  # embedding rows past the tokenizer too
    masks = cache.masks(CallSpec({"get_weather": WEATHER_SCHEMA}, named=True, close=CLOSE))
    constraint = CallConstraint(masks, frozenset({tokenizer.eos_token_id}))
    text = ' {"city": "Paris", "days": 3}}' + CLOSE
    special = set(tokenizer.all_special_ids)
    for token in tokenizer.encode(text, add_special_tokens=False):
        allowed = constraint.mask()
        # Brute force, without the shortcuts: feed every token's text to the automaton.
        expected = [
            i
            for i in range(len(tokenizer))
            if i not in special and masks.grammar.feed(constraint.state, tokenizer.decode([i])) is not None
        ]
        assert allowed.nonzero().flatten().tolist() == expected
        assert allowed[token]
        constraint.accept(token)
    assert masks.grammar.done(constraint.state)
    assert constraint.mask().nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    assert cache.masks(CallSpec({"get_weather": WEATHER_SCHEMA}, named=True, close=CLOSE)) is masks


def test_mask_lookup_is_cheap_once_states_are_known(tokenizer: Any) -> None:
    from prime_composer.inference.hf.constrain import CallConstraint, ConstraintCache

    masks = ConstraintCache(tokenizer, len(tokenizer)).masks(
        CallSpec({"get_weather": WEATHER_SCHEMA}, named=True, close=CLOSE)
    )
    ids = tokenizer.encode(' {"city": "' + "Paris " * 40 + '", "days": 3}}' + CLOSE, add_special_tokens=False)
    for _ in range(2):  # the first pass computes the masks, the second only looks them up
        constraint = CallConstraint(masks, frozenset({tokenizer.eos_token_id}))
        started = time.perf_counter()
        for token in ids:
            assert constraint.mask()[token]
            constraint.accept(token)
        elapsed = time.perf_counter() - started
    assert masks.grammar.done(constraint.state)
    print(f"{len(ids)} tokens, {masks.num_states} states, {1e6 * elapsed / len(ids):.0f} us/token cached")


# ----------------------------------------------------------------------------- vLLM replies


def _call(index: int, name: str, arguments: str) -> dict[str, Any]:
    return {
        "index": index,
        "id": f"c{index}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def test_vllm_replies_lose_calls_of_tools_not_offered() -> None:
    stats = UnknownCallStats()
    body = {
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [_call(0, "rm_rf", '{"path": "/"}'), _call(1, "get_weather", "{}")],
                },
                "finish_reason": "tool_calls",
            }
        ]
    }
    out = json.loads(ReplyFilter(frozenset({"get_weather"}), stats).whole(json.dumps(body).encode()))
    choice = out["choices"][0]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    assert choice["finish_reason"] == "unknown_tool_call" and choice["num_unknown_tool_calls"] == 1
    assert json.loads(choice["message"]["content"].split("\n")[1]) == {
        "name": "rm_rf",
        "arguments": {"path": "/"},
    }
    assert stats.num_unknown == 1 and "prime_composer_tool_calls_unknown_total 1" in stats.prometheus()

    # Streamed: the unknown call's deltas are dropped, the kept call re-indexed from 0.
    events = [
        {"choices": [{"index": 0, "delta": {"tool_calls": [{**_call(0, "rm_rf", "")}]}}]},
        {
            "choices": [
                {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"p": 1}'}}]}}
            ]
        },
        {"choices": [{"index": 0, "delta": {"tool_calls": [_call(1, "get_weather", "{}")]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    ]
    raw = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    stream = ReplyFilter(frozenset({"get_weather"}), stats)
    pieces = [stream.chunk(raw[i : i + 7], final=i + 7 >= len(raw)) for i in range(0, len(raw), 7)]
    lines = [e for e in b"".join(pieces).split(b"\n\n") if e]
    assert lines[-1] == b"data: [DONE]"
    chunks = [json.loads(e[6:]) for e in lines[:-1]]
    calls = [c for ch in chunks for c in ch["choices"][0]["delta"].get("tool_calls", [])]
    assert calls == [{**_call(1, "get_weather", "{}"), "index": 0}]
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "unknown_tool_call" and '"rm_rf"' in last["delta"]["content"]
    assert stats.num_unknown == 2


def test_forced_vllm_requests_bind_arguments_to_the_schema() -> None:
    tools = [_tool("a", WEATHER_SCHEMA), {"type": "function", "function": {"name": "b", "strict": False}}]
    body = {"tools": json.loads(json.dumps(tools)), "tool_choice": "required"}
    assert bind_forced_arguments(body)
    assert [t["function"].get("strict") for t in body["tools"]] == [True, False]  # an explicit choice stays
    auto = {"tools": json.loads(json.dumps(tools)), "tool_choice": "auto"}
    assert not bind_forced_arguments(auto) and "strict" not in auto["tools"][0]["function"]

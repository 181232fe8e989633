"""Hermes tool-call parsing: calls out, prose kept, malformed calls reported and left as text;
streamed parsing agrees with whole-text parsing however the text is cut."""

from __future__ import annotations

import json
import random

import pytest

from prime_composer.tool_calls import PARSERS, ReplyDelta, get_parser

CALL = '<tool_call>\n{"name": "run", "arguments": {"command": "pytest -q"}}\n</tool_call>'


def test_two_calls_and_prose() -> None:
    text = (
        'Let me look.\n<tool_call>{"name": "read_file", "arguments": {"path": "a.py"}}</tool_call>\n'
        '<tool_call>\n{"name": "run", "arguments": {"command": "pytest -q"}}\n</tool_call>'
    )
    reply = get_parser("hermes").parse(text)
    assert reply.content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [
        ("read_file", {"path": "a.py"}),
        ("run", {"command": "pytest -q"}),
    ]
    assert reply.malformed == [] and len({c.id for c in reply.tool_calls}) == 2
    assert reply.tool_calls[0].to_openai()["function"] == {
        "name": "read_file",
        "arguments": '{"path": "a.py"}',
    }


@pytest.mark.parametrize(
    "bad",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>["read_file"]</tool_call>',
        '<tool_call>{"name": "f", "arguments": 3}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',  # Python's JSON, not JSON
        "<tool_call>" + "[" * 100_000 + "</tool_call>",  # deeper than Python's recursion limit
        '<tool_call>{"name": "f", "arguments": {"x": 1}',
    ],
)
def test_malformed_calls_stay_text_and_are_reported(bad: str) -> None:
    reply = get_parser("hermes").parse(f"ok {bad}")
    assert reply.tool_calls == [] and reply.malformed == [bad] and reply.content == f"ok {bad}"


def test_good_calls_survive_a_malformed_neighbour() -> None:
    bad = '<tool_call>{"name": "f", "arguments": {"x": }}</tool_call>'
    reply = get_parser("hermes").parse(f"{CALL}\n{bad}\n{CALL}")
    assert [c.name for c in reply.tool_calls] == ["run", "run"]
    assert reply.malformed == [bad] and reply.content == bad


def test_serialized_arguments_and_plain_text() -> None:
    parser = get_parser("hermes")
    reply = parser.parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert json.loads(reply.tool_calls[0].arguments) == {"x": 1} and reply.content == ""
    assert parser.parse("  no calls here \n").content == "no calls here"
    assert parser.parse("no calls here").tool_calls == []
    with pytest.raises(ValueError, match="known: \\['hermes'\\]"):
        get_parser("llama9")


def test_forced_prefix_is_how_the_template_opens_a_call() -> None:
    parser = get_parser("hermes")
    assert CALL.startswith(parser.forced_prefix(None))
    assert CALL.startswith(parser.forced_prefix("run"))
    assert parser.forced_prefix("run").endswith('"arguments":')  # no trailing space (see its comment)
    assert PARSERS["hermes"]().vllm_name == "hermes"


def _pieces(text: str, rng: random.Random) -> list[str]:
    cuts = (
        sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
        if len(text) > 1
        else []
    )
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


TEXTS = [
    "",
    "   ",
    "plain prose, no calls",
    f"Let me run the tests.\n{CALL}",
    f"{CALL}\n{CALL}",
    f"  before \n\n {CALL}  middle <tool_ {CALL}\n after  ",
    'an unclosed <tool_call>\n{"name": "run"',
    f"{CALL}<tool_call>{{bad}}</tool_call> tail <tool_cal",
    "<tool_call><tool_call>{}</tool_call></tool_call>",
    "text ending in a marker prefix <tool_c",
    "nested marker text </tool_call> outside",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_add_up_to_the_whole_parse(text: str) -> None:
    parser = get_parser("hermes")
    whole = parser.parse(text)
    rng = random.Random(text)
    for pieces in [list(text), *(_pieces(text, rng) for _ in range(200))]:  # one character at a time too
        stream = parser.stream()
        total = ReplyDelta()
        for piece in pieces:
            total.extend(stream.feed(piece))
        total.extend(stream.finish())
        assert total.content == whole.content
        assert [(c.name, c.arguments) for c in total.tool_calls] == [
            (c.name, c.arguments) for c in whole.tool_calls
        ]
        assert total.malformed == whole.malformed


def test_a_call_is_handed_out_when_it_closes_and_content_never_shows_a_marker_prefix() -> None:
    stream = get_parser("hermes").stream()
    assert stream.feed("Hi <tool").content == "Hi"  # " <tool" may be the start of a call
    delta = stream.feed('_call>{"name": "f", "arguments": {}}')
    assert delta.content == "" and delta.tool_calls == []  # not closed yet: nothing handed out
    delta = stream.feed("</tool_call> and <b>")
    assert [c.name for c in delta.tool_calls] == ["f"] and delta.content == "  and <b>"  # the held space too
    assert stream.finish() == ReplyDelta()


def test_a_long_unclosed_body_is_scanned_in_linear_time() -> None:
    stream = get_parser("hermes").stream()
    stream.feed("<tool_call>")
    for _ in range(20_000):  # quadratic rescanning would take minutes here
        stream.feed("x" * 50)
    assert stream.finish().malformed[0] == "<tool_call>" + "x" * 1_000_000

"""Hermes tool-call parsing: calls out, prose kept, malformed calls reported and left as text."""

from __future__ import annotations

import json

import pytest

from prime_composer.tool_calls import get_parser


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
        '<tool_call>{"name": "f", "arguments": {"x": 1}',
    ],
)
def test_malformed_calls_stay_text_and_are_reported(bad: str) -> None:
    reply = get_parser("hermes").parse(f"ok {bad}")
    assert reply.tool_calls == [] and reply.malformed and bad in reply.content


def test_serialized_arguments_and_plain_text() -> None:
    parser = get_parser("hermes")
    reply = parser.parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert json.loads(reply.tool_calls[0].arguments) == {"x": 1} and reply.content == ""
    assert parser.parse("no calls here").tool_calls == []
    with pytest.raises(ValueError, match="known: \\['hermes'\\]"):
        get_parser("llama9")

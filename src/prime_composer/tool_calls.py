"""Parsing a model's tool calls out of its generated text, by format name.

Chat templates render tools into the prompt and models answer with tool calls written as text;
each model family has its own way of writing them. A ``ToolCallParser`` turns one reply's text
into the content the model meant as prose plus a list of ``ToolCall`` (OpenAI's shape: id,
function name, arguments as a JSON object string). Both the inference server (``message.tool_calls``
of a chat completion) and the orchestrator's multi-turn harness (which samples token-in/token-out
and parses the text itself) use the same parsers, so a call means the same thing on both paths.

A call that looks like one but does not parse (bad JSON, no name) is never an exception: its text
stays in the content and is reported in ``ParsedReply.malformed``, so callers can count it.

Parsers here:

- ``hermes`` (Hermes, Qwen 2.5 / Qwen 3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number of them, anywhere in the reply.

No torch import: every process may use this.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class ToolCall:
    """One call of a function tool, as OpenAI's ``tool_calls[i]`` has it."""

    name: str
    arguments: str
    """The arguments as a JSON object, serialized (OpenAI's ``function.arguments``)."""
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, object]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ParsedReply:
    """A reply split into prose and tool calls."""

    content: str
    """The text that is not a (well-formed) tool call, stripped."""
    tool_calls: list[ToolCall]
    malformed: list[str] = field(default_factory=list)
    """Texts that looked like tool calls but did not parse (they stay in ``content``)."""


class ToolCallParser(Protocol):
    """Turns a reply's text into content and tool calls."""

    name: str

    def parse(self, text: str) -> ParsedReply: ...


class HermesParser:
    """``<tool_call>{"name": "f", "arguments": {...}}</tool_call>`` (Hermes, Qwen 2.5 / Qwen 3)."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedReply:
        calls: list[ToolCall] = []
        malformed: list[str] = []
        kept: list[str] = []
        position = 0
        for match in self._BLOCK.finditer(text):
            kept.append(text[position : match.start()])
            position = match.end()
            call = _call_from_json(match.group(1))
            if call is None:
                malformed.append(match.group(0))
                kept.append(match.group(0))
            else:
                calls.append(call)
        rest = text[position:]
        if self.OPEN in rest:  # an opened call that never closed (cut by max_tokens, say)
            malformed.append(rest[rest.index(self.OPEN) :])
        kept.append(rest)
        return ParsedReply(content="".join(kept).strip(), tool_calls=calls, malformed=malformed)


def _call_from_json(body: str) -> ToolCall | None:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments already serialized
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name=data["name"], arguments=json.dumps(arguments, ensure_ascii=False))


PARSERS: dict[str, Callable[[], ToolCallParser]] = {"hermes": HermesParser}
"""Tool-call formats by name (``inference.tool_call_parser`` and the harness use these names)."""


def get_parser(name: str) -> ToolCallParser:
    """The parser for format ``name``; a ``ValueError`` listing the known ones otherwise."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call format {name!r}; known: {sorted(PARSERS)}")
    return PARSERS[name]()

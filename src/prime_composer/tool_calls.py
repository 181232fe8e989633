"""Parsing a model's tool calls out of its generated text, by format name, whole or streamed.

Chat templates render tools into the prompt and models answer with tool calls written as text;
each model family has its own way of writing them. A ``ToolCallParser`` turns one reply's text
into the content the model meant as prose plus a list of ``ToolCall`` (OpenAI's shape: id,
function name, arguments as a JSON object string). Both the inference server (``message.tool_calls``
of a chat completion) and the orchestrator's multi-turn harness (which samples token-in/token-out
and parses the text itself) use the same parsers, so a call means the same thing on both paths::

    reply = get_parser("hermes").parse(text)      # ParsedReply(content, tool_calls, malformed)

    stream = get_parser("hermes").stream()        # the same, text delta by text delta
    for piece in pieces:
        delta = stream.feed(piece)                # ReplyDelta(content, tool_calls, malformed)
    delta = stream.finish()

A streamed reply gives exactly what ``parse`` gives for the whole text (``parse`` *is* a stream
fed once): the same content once the deltas are joined, the same calls in the same order, the same
malformed texts. A call is handed out when its closing marker arrives, never before, so nothing
handed out is ever taken back when its JSON turns out bad.

A call that looks like one but does not parse (bad JSON, no name, arguments that are not an object,
an opening marker that never closes) is never an exception: its text stays in the content and is
reported in ``malformed``, so callers can count it. Content is stripped of leading and trailing
whitespace (the whitespace around calls the model put between them and the prose).

Each parser also names the reply prefix that forces a call (``forced_prefix``): the inference
server starts the reply with it for ``tool_choice = "required"`` or a named function, and the
vLLM parser of the same format (``vllm_name``), which the ``vllm`` backend starts vLLM with.

Parsers here:

- ``hermes`` (Hermes, Qwen 2.5 / Qwen 3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number of them, anywhere in the reply (vLLM's ``hermes``).

No torch import: every process may use this.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import ClassVar, Protocol

DEFAULT_PARSER = "hermes"
"""The format ``inference.tool_call_parser`` defaults to (the built-in tiny Qwen3 writes it)."""


@dataclass(frozen=True)
class ToolCall:
    """One call of a function tool, as OpenAI's ``tool_calls[i]`` has it."""

    name: str
    arguments: str
    """The arguments as a JSON object, serialized (OpenAI's ``function.arguments``)."""
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    source: str = field(default="", compare=False, repr=False)
    """The text the call was parsed from, markers included (``""`` when not parsed from text)."""

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


@dataclass
class ReplyDelta:
    """What one piece of a streamed reply adds: content to show now and the calls it completed."""

    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)
    """Texts completed by this piece that looked like calls but did not parse (also in ``content``)."""

    def extend(self, other: ReplyDelta) -> None:
        self.content += other.content
        self.tool_calls += other.tool_calls
        self.malformed += other.malformed


class ReplyStream(Protocol):
    """Incremental parsing of one reply."""

    def feed(self, text: str) -> ReplyDelta: ...

    def finish(self) -> ReplyDelta:
        """The end of the reply: what was held back (a possible marker, an unclosed call)."""
        ...


class ToolCallParser(Protocol):
    """Turns a reply's text into content and tool calls."""

    @property
    def name(self) -> str: ...

    @property
    def vllm_name(self) -> str:
        """The name of vLLM's parser for the same format (``--tool-call-parser``)."""
        ...

    def parse(self, text: str) -> ParsedReply: ...

    def stream(self) -> ReplyStream: ...

    def forced_prefix(self, function: str | None) -> str:
        """The start of a reply that is a call: of ``function``, or of any function (``None``)."""
        ...


class TaggedJSONParser:
    """Calls written as ``OPEN <json object> CLOSE``; subclasses set the markers and read the object."""

    name: ClassVar[str]
    vllm_name: ClassVar[str]
    OPEN: ClassVar[str]
    CLOSE: ClassVar[str]

    def call_from_body(self, body: str) -> ToolCall | None:
        """The call written between the markers, or ``None`` when it is not a well-formed call."""
        raise NotImplementedError

    def forced_prefix(self, function: str | None) -> str:
        raise NotImplementedError

    def stream(self) -> _TaggedStream:
        return _TaggedStream(self)

    def parse(self, text: str) -> ParsedReply:
        stream = self.stream()
        reply = stream.feed(text)
        reply.extend(stream.finish())
        return ParsedReply(content=reply.content, tool_calls=reply.tool_calls, malformed=reply.malformed)


class HermesParser(TaggedJSONParser):
    """``<tool_call>{"name": "f", "arguments": {...}}</tool_call>`` (Hermes, Qwen 2.5 / Qwen 3)."""

    name = "hermes"
    vllm_name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def call_from_body(self, body: str) -> ToolCall | None:
        return _call_from_json(body)

    def forced_prefix(self, function: str | None) -> str:
        # As Qwen's chat template writes a call. A named prefix stops before the space that
        # precedes the arguments: BPE tokenizers glue a space to the next token (" {"), so a
        # prompt ending in a space would ask the model for a token sequence it never saw.
        if function is None:
            return f"{self.OPEN}\n"
        return f'{self.OPEN}\n{{"name": {json.dumps(function, ensure_ascii=False)}, "arguments":'


class _TaggedStream:
    """The state machine behind ``TaggedJSONParser``: outside a call, content flows out except a
    tail that may be the start of ``OPEN``; inside, the body is kept (in pieces, so a long body
    costs linear time) until ``CLOSE`` arrives."""

    def __init__(self, parser: TaggedJSONParser) -> None:
        self._parser = parser
        self._inside = False
        self._held = ""
        """Outside: the end of the text so far, when it may be the start of ``OPEN``."""
        self._body: list[str] = []
        """Inside: the call's body so far, in the pieces it came in."""
        self._body_length = 0
        self._tail = ""
        """Inside: the body's last ``len(CLOSE) - 1`` characters (where ``CLOSE`` may have begun)."""
        self._started = False
        """Whether content other than whitespace was handed out (leading whitespace is dropped)."""
        self._whitespace = ""
        """Trailing whitespace held back until more content follows (dropped at the end)."""

    def feed(self, text: str) -> ReplyDelta:
        delta = ReplyDelta()
        open_, close = self._parser.OPEN, self._parser.CLOSE
        while True:
            if self._inside:
                window = self._tail + text
                end = window.find(close)
                if end == -1:
                    self._body.append(text)
                    self._body_length += len(text)
                    self._tail = window[max(0, len(window) - len(close) + 1) :]
                    return delta
                whole = "".join(self._body) + text
                at = self._body_length - len(self._tail) + end
                body, text = whole[:at], whole[at + len(close) :]
                self._inside, self._body, self._body_length, self._tail = False, [], 0, ""
                call = self._parser.call_from_body(body)
                block = open_ + body + close
                if call is not None:
                    delta.tool_calls.append(replace(call, source=block))
                else:
                    delta.malformed.append(block)
                    self._content(delta, block)
            else:
                text, self._held = self._held + text, ""
                start = text.find(open_)
                if start == -1:
                    keep = _marker_prefix_length(text, open_)
                    self._content(delta, text[: len(text) - keep])
                    self._held = text[len(text) - keep :]
                    return delta
                self._content(delta, text[:start])
                text = text[start + len(open_) :]
                self._inside = True

    def finish(self) -> ReplyDelta:
        delta = ReplyDelta()
        if self._inside:  # an opened call that never closed (cut by max_tokens, say)
            block = self._parser.OPEN + "".join(self._body)
            delta.malformed.append(block)
            self._content(delta, block)
        else:
            self._content(delta, self._held)
        self._inside, self._held, self._body, self._body_length, self._tail = False, "", [], 0, ""
        self._whitespace = ""
        return delta

    def _content(self, delta: ReplyDelta, text: str) -> None:
        if not self._started:
            text = text.lstrip()
            if not text:
                return
            self._started = True
        body = text.rstrip()
        if body:
            delta.content += self._whitespace + body
            self._whitespace = text[len(body) :]
        else:
            self._whitespace += text


def _marker_prefix_length(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``marker``."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


def _strict_json(text: str) -> object:
    """``json.loads`` without Python's extensions (``NaN``, ``Infinity``); ``ValueError`` when the
    text is not JSON, nested too deep included (model output is untrusted input)."""

    def refuse(constant: str) -> object:
        raise ValueError(f"{constant} is not JSON")

    try:
        return json.loads(text, parse_constant=refuse)
    except RecursionError:
        raise ValueError("nested too deep") from None


def _call_from_json(body: str) -> ToolCall | None:
    try:
        data = _strict_json(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments already serialized
        try:
            arguments = _strict_json(arguments)
        except ValueError:
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

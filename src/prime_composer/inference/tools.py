"""Tool calls on the ``hf`` server: what a chat request's ``tools`` and ``tool_choice`` ask for, how
tools and earlier calls reach the chat template, and how each choice's reply is read back.

The reply is parsed by ``inference.tool_call_parser`` (a ``prime_composer.tool_calls`` format, the
one the multi-turn harness parses token-in/token-out text with). ``tool_choice``, as OpenAI and
vLLM define it:

- ``auto`` (the default when ``tools`` are given): the model decides; well-formed calls come back
  in ``message.tool_calls`` (``finish_reason = "tool_calls"``), the rest as ``content``;
- ``none``: the tools are still rendered into the prompt (vLLM's default), the reply is returned
  as text, unparsed and unstripped;
- ``required`` / a named function (``{"type": "function", "function": {"name": ...}}``): the reply
  is *started* for the model with the parser's opening of a call (``forced_prefix``: for hermes
  ``<tool_call>\\n``, or ``<tool_call>\\n{"name": "f", "arguments":``), then sampled under a
  grammar (``call_grammar``, applied token by token by ``hf.constrain``): the name of an offered
  tool (``required``), JSON arguments valid for its schema, the call's close, then an end token.
  The reply is therefore one parsable call, unless ``max_tokens`` cuts it (then it is content,
  counted as malformed, ``finish_reason = "length"``). The forced text is part of
  ``prompt_token_ids`` (it was not sampled: it has no logprob and must not be trained on),
  ``token_ids`` and ``logprobs`` cover the sampled tokens only; their logprobs are those of the
  constrained distribution. As in OpenAI's API, a named call finishes with
  ``finish_reason = "stop"``;
- ``parallel_tool_calls = false``: only the first call is returned (the others are dropped, as
  vLLM does);
- a call of a function that is not in ``tools`` (possible with ``auto``) is never returned in
  ``tool_calls``: its text stays in ``content``, the choice's ``finish_reason`` is
  ``UNKNOWN_TOOL_FINISH`` (``"unknown_tool_call"``), the choice counts it in
  ``num_unknown_tool_calls`` and ``/metrics`` in ``prime_composer_tool_calls_unknown_total``.

Each parsed choice carries ``num_malformed_tool_calls`` (a field OpenAI clients ignore), and the
server counts replies, calls and malformed calls on ``/metrics``. Messages may hold earlier calls
(``role: assistant`` with ``tool_calls``; their JSON ``arguments`` become objects, as tool-use chat
templates expect and vLLM does) and results (``role: tool``). Tools reach the template in vLLM's
normal form (``{"type": "function", "function": {"name", "description", "parameters"}}``), so both
backends render the same prompt. A template that never reads ``tools`` would drop them silently:
such a request is refused instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from prime_composer.inference.call_grammar import CallSpec
from prime_composer.inference.conformance import UNKNOWN_TOOL_FINISH, check_tools
from prime_composer.inference.guard import APIError
from prime_composer.inference.protocol import ChatCompletionRequest
from prime_composer.tool_calls import HermesParser, ReplyDelta, ToolCallParser, get_parser


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request's replies are read (``NO_TOOLS``: as text)."""

    parser: ToolCallParser | None = None
    """Parses the replies; ``None`` returns them as text."""
    reply_prefix: str = ""
    """Text the reply is started with (``required`` / a named function), appended to the prompt."""
    function: str | None = None
    """The function ``tool_choice`` names."""
    single_call: bool = False
    """``parallel_tool_calls = false``: return the first call only."""
    offered: frozenset[str] = frozenset()
    """The names in ``tools``: a call of any other function is not returned as a call."""

    def call_spec(self, tools: list[dict[str, Any]]) -> CallSpec | None:
        """The grammar a forced call is decoded under (``None``: not forced, or a parser whose
        layout the grammar does not know). ``tools`` must be checked (``template_tools``)."""
        if not self.reply_prefix or not isinstance(self.parser, HermesParser):
            return None
        schemas = {
            t["function"]["name"]: t["function"].get("parameters")
            for t in tools
            if self.function is None or t["function"]["name"] == self.function
        }
        return CallSpec(schemas, named=self.function is not None, close="\n" + self.parser.CLOSE)

    def reader(self) -> ReplyReader:
        assert self.parser is not None, "a plan without a parser returns replies as text"
        return ReplyReader(self)

    def finish_reason(self, reason: str | None, num_calls: int, num_unknown: int = 0) -> str | None:
        """OpenAI's: ``tool_calls`` when a reply that stopped by itself made calls, unless a named
        function was forced (then ``stop``); ``UNKNOWN_TOOL_FINISH`` when it called a function
        that was not offered."""
        if num_unknown and reason == "stop":
            return UNKNOWN_TOOL_FINISH
        if num_calls and reason == "stop" and self.function is None:
            return "tool_calls"
        return reason


NO_TOOLS = ToolPlan()


def plan_tools(body: ChatCompletionRequest, parser_name: str | None) -> ToolPlan:
    """The plan for ``body``; a 400 for a ``tool_choice`` that cannot be served. Only the cheap
    checks run here, on the event loop; ``tools`` themselves are checked with the rendering."""
    if body.tools is not None and not body.tools:
        raise APIError(400, "tools must not be an empty array: give at least one tool or leave it out")
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools: give the tools the model may call")
        return NO_TOOLS
    if choice is None:
        choice = "auto"  # OpenAI's and vLLM's default when tools are given
    function = _named_function(choice)
    if choice == "none":
        return NO_TOOLS
    if parser_name is None:
        raise APIError(
            400,
            f"tool_choice = {choice!r} needs a tool-call parser, and this server runs with "
            "inference.tool_call_parser = 'none'; send tool_choice = 'none' to get the reply as text",
        )
    parser = get_parser(parser_name)
    prefix = "" if choice == "auto" else parser.forced_prefix(function)
    if prefix and body.continue_final_message:
        raise APIError(400, f"tool_choice = {choice!r} starts a new reply; it cannot continue_final_message")
    offered = frozenset(
        t["function"]["name"]
        for t in body.tools
        if isinstance(t, dict)
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
    )
    if prefix and body.ignore_eos:
        raise APIError(
            400,
            f"tool_choice = {choice!r} ends the reply after the call; it cannot be combined with ignore_eos",
            param="ignore_eos",
        )
    return ToolPlan(parser, prefix, function, single_call=body.parallel_tool_calls is False, offered=offered)


def _named_function(choice: Any) -> str | None:
    if choice in ("none", "auto", "required"):
        return None
    usage = 'use "none", "auto", "required" or {"type": "function", "function": {"name": "<tool>"}}'
    if not isinstance(choice, dict):
        raise APIError(400, f"tool_choice = {choice!r} is not a tool choice; {usage}")
    function = choice.get("function")
    if choice.get("type", "function") != "function" or not isinstance(function, dict):
        raise APIError(400, f"tool_choice: only function tools can be named; {usage}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise APIError(400, f"tool_choice.function.name must be a non-empty string; {usage}")
    return name


class ReplyReader:
    """Reads one choice's reply with the plan's parser, whole or streamed (the same code: a whole
    reply is one ``feed`` with ``final``), and counts what it found."""

    def __init__(self, plan: ToolPlan) -> None:
        assert plan.parser is not None
        self._plan = plan
        self._stream = plan.parser.stream()
        self.num_calls = 0
        self.num_malformed = 0
        self.num_unknown = 0
        self._content_sent = False
        if plan.reply_prefix:  # the forced start opens a call: it hands nothing out by itself
            self._stream.feed(plan.reply_prefix)

    def feed(self, text: str, final: bool) -> ReplyDelta:
        delta = self._stream.feed(text)
        if final:
            delta.extend(self._stream.finish())
        unknown = [c for c in delta.tool_calls if c.name not in self._plan.offered]
        if unknown:  # kept as the text the model wrote, never handed out as a call
            delta.tool_calls = [c for c in delta.tool_calls if c.name in self._plan.offered]
            self.num_unknown += len(unknown)
            for call in unknown:
                joint = "\n" if (self._content_sent or delta.content) else ""
                delta.content += joint + call.source
        self._content_sent = self._content_sent or bool(delta.content)
        if self._plan.single_call:
            delta.tool_calls = delta.tool_calls[: max(0, 1 - self.num_calls)]
        self.num_calls += len(delta.tool_calls)
        self.num_malformed += len(delta.malformed)
        return delta


@dataclass
class ToolCallStats:
    """Counters over every parsed reply since the server started (served on ``/metrics``)."""

    num_replies: int = 0
    num_calls: int = 0
    num_malformed: int = 0
    num_unknown: int = 0

    def record(self, reader: ReplyReader) -> None:
        """Count a finished reply."""
        self.num_replies += 1
        self.num_calls += reader.num_calls
        self.num_malformed += reader.num_malformed
        self.num_unknown += reader.num_unknown

    def prometheus(self) -> str:
        """The counters in Prometheus' text format (what vLLM's ``/metrics`` speaks)."""
        lines = []
        for name, value, help_text in (
            ("tool_call_replies", self.num_replies, "Chat replies parsed for tool calls."),
            ("tool_calls", self.num_calls, "Well-formed tool calls returned in message.tool_calls."),
            (
                "tool_calls_malformed",
                self.num_malformed,
                "Texts that looked like tool calls but did not parse (returned as content).",
            ),
            (
                "tool_calls_unknown",
                self.num_unknown,
                "Calls of functions not in the request's tools (returned as content).",
            ),
        ):
            metric = f"prime_composer_{name}_total"
            lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} counter", f"{metric} {value}"]
        return "\n".join(lines) + "\n"


# --------------------------------------------------------------------- rendering (worker threads)


def template_tools(tools: list[dict[str, Any]], function: str | None) -> list[dict[str, Any]]:
    """``tools`` in the form vLLM hands chat templates; a 400 naming ``tools[i]`` for a bad entry,
    or when the function ``tool_choice`` names is not among them."""
    check_tools(tools)
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        spec = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(spec, dict):
            raise APIError(400, f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}')
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, f"tools[{i}].function.name must be a non-empty string")
        description, parameters, strict = spec.get("description"), spec.get("parameters"), spec.get("strict")
        if description is not None and not isinstance(description, str):
            raise APIError(400, f"tools[{i}].function.description must be a string")
        if parameters is not None and not isinstance(parameters, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON Schema object")
        if strict is not None and not isinstance(strict, bool):
            raise APIError(400, f"tools[{i}].function.strict must be a boolean")
        rendered: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
        if strict is not None:
            rendered["strict"] = strict
        out.append({"type": "function", "function": rendered})
    if function is not None and all(t["function"]["name"] != function for t in out):
        raise APIError(400, f"tool_choice names the function {function!r}, which is not in tools")
    return out


def template_message(message: dict[str, Any], position: int) -> dict[str, Any]:
    """An assistant message's ``tool_calls`` with their ``arguments`` as objects (an empty list is
    dropped, so the template takes its plain path); a 400 naming the field for a bad call."""
    calls = message.get("tool_calls")
    if calls is None or message.get("role") != "assistant":
        return message
    where = f"messages[{position}].tool_calls"
    if not isinstance(calls, list):
        raise APIError(400, f"{where} must be a list")
    if not calls:
        return {k: v for k, v in message.items() if k != "tool_calls"}
    normalized = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise APIError(400, f'{where}[{j}] must be {{"type": "function", "function": {{...}}}}')
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise APIError(400, f"{where}[{j}].function.name must be a non-empty string")
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                arguments = None
        if not isinstance(arguments, dict):
            raise APIError(400, f"{where}[{j}].function.arguments must be a JSON object (or its text)")
        normalized.append({**call, "function": {**function, "arguments": arguments}})
    return {**message, "tool_calls": normalized}


def template_reads_tools(template: Any) -> bool:
    """Whether a chat template (its source, or a dict of named templates) can render ``tools``:
    one that never mentions them would drop them without a word."""
    if isinstance(template, dict):
        return any(template_reads_tools(t) for t in template.values())
    return isinstance(template, str) and "tools" in template

"""OpenAI conformance in front of vLLM's chat route (run by the ``admin`` middleware, inside vLLM's
process; no torch, no vLLM import at module level).

Requests: a ``POST /v1/chat/completions`` body is held to ``conformance.check_chat_body`` before
vLLM sees it (tool names, duplicate names, JSON Schemas, which call each ``tool`` message answers),
and its fields to those vLLM's own request schema implements plus ``conformance.IGNORED_FIELDS``
(vLLM would drop any other with a warning; here it is a 400 naming it).

Replies: vLLM's parser returns a call of any function the model names. ``ReplyFilter`` takes calls
of functions that are not in the request's ``tools`` out of ``tool_calls`` (streamed or not), puts
their text in ``content`` (as the ``hf`` backend keeps it), sets ``finish_reason`` to
``conformance.UNKNOWN_TOOL_FINISH``, ``num_unknown_tool_calls`` on the choice, and counts them for
``/metrics`` (``UnknownCallStats``, appended to vLLM's own metrics).

With ``tool_choice = "required"`` or a named function vLLM itself decodes under a grammar (its
structured outputs: a JSON array of calls of the offered functions, or the named function's
parameters schema); the arguments are bound to the tool's schema only for tools marked
``strict``, so such requests are forwarded with ``strict: true`` on every tool that does not set
it (``bind_forced_arguments``), as the ``hf`` backend's grammar holds them to the schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from prime_composer.inference.conformance import UNKNOWN_TOOL_FINISH

_UNKNOWN_METRIC = "prime_composer_tool_calls_unknown_total"


def vllm_chat_fields() -> frozenset[str] | None:
    """The fields of vLLM's chat request schema (``None`` when it cannot be imported: then
    unknown fields are left to vLLM)."""
    for module in ("vllm.entrypoints.openai.chat_completion.protocol", "vllm.entrypoints.openai.protocol"):
        try:
            schema = __import__(module, fromlist=["ChatCompletionRequest"]).ChatCompletionRequest
        except (ImportError, AttributeError):
            continue
        return frozenset(schema.model_fields)
    return None


def bind_forced_arguments(body: dict[str, Any]) -> bool:
    """With ``tool_choice`` required or named, mark every tool that does not say otherwise
    ``strict`` (in place), so vLLM's grammar binds the arguments to the tool's schema rather than
    to any JSON value (its ``--tool-strict-level auto``); whether ``body`` changed."""
    choice, tools = body.get("tool_choice"), body.get("tools")
    if not (choice == "required" or isinstance(choice, dict)) or not isinstance(tools, list):
        return False
    changed = False
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and "strict" not in function:
            function["strict"] = True
            changed = True
    return changed


def offered_tools(body: dict[str, Any]) -> frozenset[str] | None:
    """The function names a reply may call, or ``None`` when replies are not parsed for calls."""
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools or body.get("tool_choice") == "none":
        return None
    return frozenset(
        t["function"]["name"]
        for t in tools
        if isinstance(t, dict)
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
    )


@dataclass
class UnknownCallStats:
    num_unknown: int = 0

    def prometheus(self) -> str:
        return (
            f"# HELP {_UNKNOWN_METRIC} Calls of functions not in the request's tools (returned as content).\n"
            f"# TYPE {_UNKNOWN_METRIC} counter\n{_UNKNOWN_METRIC} {self.num_unknown}\n"
        )


def call_text(name: str, arguments: str) -> str:
    """A call as the hermes format writes it (what the model generated, up to its spacing)."""
    try:
        args: Any = json.loads(arguments)
    except ValueError:
        args = arguments
    return (
        "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"
    )


@dataclass
class _StreamedChoice:
    new_index: dict[int, int | None] = field(default_factory=dict)
    """vLLM's call index -> ours (``None``: an unknown function, dropped)."""
    unknown: dict[int, list[str]] = field(default_factory=dict)
    """Dropped calls: name and arguments so far."""
    num_kept: int = 0


class ReplyFilter:
    """Rewrites one chat response of vLLM's (whole or as server-sent events)."""

    def __init__(self, offered: frozenset[str], stats: UnknownCallStats) -> None:
        self.offered, self.stats = offered, stats
        self._choices: dict[int, _StreamedChoice] = {}
        self._pending = b""

    # ------------------------------------------------------------------ whole responses

    def whole(self, body: bytes) -> bytes:
        try:
            data = json.loads(body)
        except ValueError:
            return body
        changed = False
        for choice in data.get("choices") or []:
            message = choice.get("message") or {}
            calls = message.get("tool_calls") or []
            unknown = [c for c in calls if (c.get("function") or {}).get("name") not in self.offered]
            choice["num_unknown_tool_calls"] = len(unknown)
            if not unknown:
                continue
            changed = True
            self.stats.num_unknown += len(unknown)
            message["tool_calls"] = [c for c in calls if c not in unknown]
            texts = [message.get("content") or ""] + [
                call_text(c["function"]["name"], c["function"].get("arguments") or "{}") for c in unknown
            ]
            message["content"] = "\n".join(t for t in texts if t)
            choice["finish_reason"] = _flagged(choice.get("finish_reason"))
        return json.dumps(data).encode() if changed or data.get("choices") else body

    # ------------------------------------------------------------------ streams

    def chunk(self, data: bytes, final: bool) -> bytes:
        """The rewritten events of ``data`` (a piece of the stream; events may span pieces)."""
        self._pending += data
        *events, self._pending = self._pending.split(b"\n\n")
        if final and self._pending:
            events, self._pending = [*events, self._pending], b""
        return b"".join(self._event(e) + b"\n\n" for e in events)

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            return event
        try:
            data = json.loads(event[6:])
        except ValueError:
            return event
        for choice in data.get("choices") or []:
            self._streamed(choice)
        return b"data: " + json.dumps(data).encode()

    def _streamed(self, choice: dict[str, Any]) -> None:
        state = self._choices.setdefault(int(choice.get("index", 0)), _StreamedChoice())
        delta = choice.get("delta") or {}
        kept = []
        for call in delta.get("tool_calls") or []:
            index = int(call.get("index", 0))
            if index not in state.new_index:
                name = (call.get("function") or {}).get("name")
                if name in self.offered:
                    state.new_index[index] = state.num_kept
                    state.num_kept += 1
                else:
                    state.new_index[index] = None
                    state.unknown[index] = [str(name), ""]
                    self.stats.num_unknown += 1
            ours = state.new_index[index]
            if ours is None:
                state.unknown[index][1] += (call.get("function") or {}).get("arguments") or ""
                continue
            kept.append({**call, "index": ours})
        if "tool_calls" in delta:
            if kept:
                delta["tool_calls"] = kept
            else:
                del delta["tool_calls"]
        if choice.get("finish_reason") is not None:
            choice["num_unknown_tool_calls"] = len(state.unknown)
            if state.unknown:
                texts = [call_text(name, arguments or "{}") for name, arguments in state.unknown.values()]
                delta["content"] = (delta.get("content") or "") + "\n" + "\n".join(texts)
                choice["finish_reason"] = _flagged(choice["finish_reason"])
        choice["delta"] = delta


def _flagged(reason: str | None) -> str | None:
    return UNKNOWN_TOOL_FINISH if reason in ("stop", "tool_calls") else reason

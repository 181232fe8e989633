"""Actions: what an agent does at a step, in a canonical form that votes can be counted on.

An action is either one or more tool calls or a plain message. Two actions are *equivalent* (one
cluster) when their canonical forms are equal:

- tool names are lower-cased and mapped through a few aliases (``shell``/``terminal`` -> ``bash``);
- arguments given as a JSON string are parsed; keys are sorted;
- shell commands (``command``/``cmd``/``script`` arguments) are split and re-joined the way a
  shell would read them (quoting and spacing do not matter) and ``python -m pytest`` is ``pytest``;
- paths (``path``, ``file``, ``file_path``, ...) are normalized (``./a//b.py`` is ``a/b.py``);
- code (``content``, ``new_str``, ``old_str``, ``patch``, ``code``, ...) loses trailing spaces,
  CRLF line ends and surrounding blank lines;
- a message's text is compared lower-cased with collapsed whitespace.

The assistant's free text around tool calls (its "thoughts") is not part of the action.

``render_action`` writes an action the way the student emits it (``<tool_call>`` JSON blocks, the
Hermes/Qwen convention, or the message text); both sides of a pair are rendered by it, so a pair
differs in what the agent does, not in formatting.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
from dataclasses import dataclass
from typing import Any

from prime_composer.teacher.traces import Turn

TOOL_ALIASES = {
    "shell": "bash",
    "terminal": "bash",
    "execute_bash": "bash",
    "run_command": "bash",
    "sh": "bash",
}
COMMAND_KEYS = frozenset({"command", "cmd", "script"})
PATH_KEYS = frozenset({"path", "file", "file_path", "filepath", "filename", "target"})
CODE_KEYS = frozenset({"content", "code", "new_str", "old_str", "patch", "diff", "text", "file_text"})
_COMMAND_ALIASES = (
    (("python", "-m", "pytest"), ("pytest",)),
    (("python3", "-m", "pytest"), ("pytest",)),
    (("python3",), ("python",)),
)


@dataclass(frozen=True)
class Call:
    """One canonical tool call."""

    name: str
    arguments: Any
    """Canonical arguments (a dict with normalized values, or a normalized string)."""


@dataclass(frozen=True)
class Action:
    """A canonical action: tool calls, or a message when there are none."""

    calls: tuple[Call, ...] = ()
    message: str | None = None

    @property
    def key(self) -> str:
        """The cluster key: equal keys are equivalent actions."""
        if self.calls:
            body: Any = [[c.name, c.arguments] for c in self.calls]
        else:
            body = {"message": " ".join((self.message or "").lower().split())}
        return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    @property
    def is_message(self) -> bool:
        return not self.calls


# ------------------------------------------------------------------------------- normalization


def normalize_command(command: str) -> str:
    """A shell command as a shell would read it: quoting and spacing are not part of it."""
    try:
        words = shlex.split(command, comments=False, posix=True)
    except ValueError:  # unbalanced quotes: compare by whitespace only
        return " ".join(command.split())
    for alias, canonical in _COMMAND_ALIASES:
        if tuple(words[: len(alias)]) == alias:
            words = [*canonical, *words[len(alias) :]]
            break
    return shlex.join(words)


def normalize_path(path: str) -> str:
    path = path.strip()
    if not path:
        return path
    normalized = posixpath.normpath(path)
    return normalized[2:] if normalized.startswith("./") else normalized


def normalize_code(code: str) -> str:
    lines = [line.rstrip() for line in code.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    return "\n".join(lines).strip("\n")


def _normalize_value(key: str, value: Any) -> Any:
    if isinstance(value, str):
        if key in COMMAND_KEYS:
            return normalize_command(value)
        if key in PATH_KEYS:
            return normalize_path(value)
        if key in CODE_KEYS:
            return normalize_code(value)
        return value.strip()
    if isinstance(value, dict):
        return {str(k): _normalize_value(str(k), v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_normalize_value(key, v) for v in value]
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def canonical_call(name: str, arguments: Any) -> Call:
    """The canonical form of a call of ``name`` with ``arguments`` (an object or a JSON string)."""
    tool = name.strip().lower()
    tool = TOOL_ALIASES.get(tool, tool)
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            parsed = arguments
        arguments = parsed
    if isinstance(arguments, dict):
        return Call(tool, _normalize_value("", arguments))
    if isinstance(arguments, str):
        return Call(tool, normalize_code(arguments))
    return Call(tool, _normalize_value("", arguments))


def turn_action(turn: Turn) -> Action:
    """The canonical action of an assistant turn of a trace."""
    if turn.tool_calls:
        return Action(calls=tuple(canonical_call(c.name, c.arguments) for c in turn.tool_calls))
    return Action(message=turn.content.strip())


# ------------------------------------------------------------------------------------- parsing

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ParseError(ValueError):
    """A teacher's answer that holds no action (recorded as a malformed answer)."""


def _calls_from_object(obj: Any) -> Action:
    if not isinstance(obj, dict):
        raise ParseError(f"the JSON answer is a {type(obj).__name__}, not an object")
    if "tool_calls" in obj and isinstance(obj["tool_calls"], list) and obj["tool_calls"]:
        calls = []
        for call in obj["tool_calls"]:
            inner = call.get("function", call) if isinstance(call, dict) else None
            if not isinstance(inner, dict) or not isinstance(inner.get("name"), str):
                raise ParseError("a tool_calls entry has no name")
            calls.append(canonical_call(inner["name"], inner.get("arguments", {})))
        return Action(calls=tuple(calls))
    name = obj.get("tool", obj.get("name"))
    if isinstance(name, str) and name.strip():
        return Action(calls=(canonical_call(name, obj.get("arguments", obj.get("args", {}))),))
    message = obj.get("message")
    if isinstance(message, str) and message.strip():
        return Action(message=message.strip())
    raise ParseError('the JSON object has neither "tool" (with "arguments") nor "message"')


def _first_json_object(text: str) -> Any:
    decoder = json.JSONDecoder()
    for start in (i for i, ch in enumerate(text) if ch == "{"):
        try:
            value, _ = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            continue
        return value
    raise ParseError("the answer holds no JSON object")


def parse_answer(message: dict[str, Any]) -> Action:
    """The action in a chat completion's ``choices[0].message``: its native ``tool_calls``, or a JSON
    object in its content (bare, fenced, or in ``<tool_call>`` tags). ``ParseError`` otherwise."""
    native = message.get("tool_calls")
    if isinstance(native, list) and native:
        return _calls_from_object({"tool_calls": native})
    content = message.get("content")
    if not isinstance(content, str) or not content.strip():
        raise ParseError("the answer is empty")
    text = _THINK.sub("", content)
    tagged = _TOOL_CALL.findall(text)
    if tagged:
        calls: list[Call] = []
        for block in tagged:
            try:
                calls.extend(_calls_from_object(json.loads(block)).calls)
            except json.JSONDecodeError as e:
                raise ParseError(f"a <tool_call> block is not JSON ({e})") from None
        if calls:
            return Action(calls=tuple(calls))
    for fenced in _FENCE.findall(text):
        try:
            return _calls_from_object(json.loads(fenced))
        except json.JSONDecodeError:
            continue
    return _calls_from_object(_first_json_object(text))


def parse_agent_reply(message: dict[str, Any]) -> Action:
    """The action of a teacher that plays the agent (``protocol = "agent"``): its tool calls (native,
    or ``<tool_call>`` blocks as the student writes them), else its whole text as a message, the way
    the student's own turn is read (``turn_action``). ``ParseError`` for an empty reply."""
    native = message.get("tool_calls")
    content = message.get("content")
    text = _THINK.sub("", content).strip() if isinstance(content, str) else ""
    if (isinstance(native, list) and native) or _TOOL_CALL.search(text):
        return parse_answer(message)
    if not text:
        raise ParseError("the answer is empty")
    return Action(message=text)


# ----------------------------------------------------------------------------------- rendering


def render_action(action: Action) -> str:
    """The action as the student writes it: ``<tool_call>`` JSON blocks, or the message text."""
    if action.is_message:
        return action.message or ""
    return "\n".join(
        "<tool_call>\n"
        + json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False)
        + "\n</tool_call>"
        for c in action.calls
    )


def action_to_json(action: Action) -> dict[str, Any]:
    """A JSON-able form of a canonical action (what the response cache stores)."""
    return {"calls": [[c.name, c.arguments] for c in action.calls], "message": action.message}


def action_from_json(data: dict[str, Any]) -> Action:
    return Action(
        calls=tuple(Call(name, arguments) for name, arguments in data["calls"]), message=data["message"]
    )

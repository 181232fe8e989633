"""The OpenAI rules a chat request is held to before it is served, on both backends (no torch:
the ``vllm`` backend's middleware runs these inside vLLM's process).

OpenAI answers 400 for each of these; so do we, naming the field (``param`` in the error body):

- ``tools[i].function.name`` must match ``^[a-zA-Z0-9_-]{1,64}$``, and no two tools share a name;
- ``tools[i].function.parameters`` must be a valid JSON Schema (``check_schema``: keywords with
  the types the specification gives them, known type names, unique ``required`` names, nested
  schemas valid too) whose top level is ``"type": "object"``;
- a ``tool`` message must answer a call of the assistant message it follows
  (``tool_call_id`` naming one of that message's ``tool_calls``, once);
- an assistant message with ``tool_calls`` must be followed by a ``tool`` message for each call,
  before any other message; each call has an ``id``, unique in its message;
- request fields: those the server implements, plus ``IGNORED_FIELDS`` (they do not change the
  output; accepted and ignored); any other field is refused (``unknown_fields_error``) rather
  than silently dropped (``null`` counts as unset). ``REFUSED_HINTS`` says what to send instead
  for the common ones.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from prime_composer.inference.guard import APIError

UNKNOWN_TOOL_FINISH = "unknown_tool_call"
"""The ``finish_reason`` of a choice that called a function not in ``tools`` (both backends)."""
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_SCHEMA_DEPTH = 64

IGNORED_FIELDS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "priority",
        "cache_salt",
        "request_id",
    }
)
"""Fields accepted and ignored: bookkeeping and routing hints that do not change the output."""

REFUSED_HINTS = {
    "functions": "send the functions as tools = [{type: function, function: {...}}]",
    "function_call": "send tool_choice instead",
    "reasoning_effort": "reasoning effort is not implemented; leave it unset",
    "modalities": "this server returns text only; leave it unset",
    "audio": "this server returns text only; leave it unset",
    "prediction": "predicted outputs are not implemented; leave it unset",
    "web_search_options": "web search is not implemented; leave it unset",
    "verbosity": "verbosity is not implemented; leave it unset",
}

_TYPES = frozenset({"string", "number", "integer", "boolean", "array", "object", "null"})
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("additionalProperties", "items", "not", "contains", "propertyNames", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_STRINGS = ("title", "description", "format", "pattern", "$ref", "$schema", "$id", "$comment")


def bad(message: str, param: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def unknown_fields_error(fields: Mapping[str, Any], known: Iterable[str]) -> APIError | None:
    """The 400 for the first field neither implemented (``known``) nor in ``IGNORED_FIELDS``; a
    field sent as ``null`` is unset (clients write unset options that way) and passes."""
    known = set(known)
    for name, value in fields.items():
        if name in known or name in IGNORED_FIELDS or value is None:
            continue
        hint = REFUSED_HINTS.get(
            name,
            "it is not a field this server implements; remove it (ignored fields: "
            + ", ".join(sorted(IGNORED_FIELDS))
            + ")",
        )
        return bad(f"unknown or unsupported request field; {hint}", name)
    return None


def check_tools(tools: Any) -> None:
    """Names and schemas of ``tools`` (shapes are checked by ``tools.template_tools``)."""
    if not isinstance(tools, list):
        return
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        spec = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(spec, dict):
            continue  # template_tools names the bad shape
        name = spec.get("name")
        where = f"tools[{i}].function.name"
        if isinstance(name, str):
            if not TOOL_NAME.fullmatch(name):
                raise bad(
                    f"{name!r} is not a valid function name: use 1 to 64 letters, digits, '_' or '-'",
                    where,
                )
            if name in seen:
                raise bad(
                    f"{name!r} is already the name of tools[{seen[name]}]: tool names must be unique", where
                )
            seen[name] = i
        parameters = spec.get("parameters")
        if isinstance(parameters, dict):
            where = f"tools[{i}].function.parameters"
            check_schema(parameters, where)
            kind = parameters.get("type", "object")
            if kind != "object":
                raise bad(f'the parameters schema must have "type": "object", got {kind!r}', where)


def check_schema(schema: Any, where: str, depth: int = 0) -> None:
    """A 400 naming the place in ``schema`` that is not valid JSON Schema (the keywords that
    constrain tool arguments; unknown keywords are allowed, as the specification says)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise bad(f"a JSON Schema must be an object or a boolean, got {type(schema).__name__}", where)
    if depth > MAX_SCHEMA_DEPTH:
        raise bad(f"the schema is nested deeper than {MAX_SCHEMA_DEPTH} levels", where)
    if "type" in schema:
        kind = schema["type"]
        kinds = kind if isinstance(kind, list) else [kind]
        if (
            not kinds
            or any(not isinstance(k, str) or k not in _TYPES for k in kinds)
            or len(set(map(str, kinds))) != len(kinds)
        ):
            raise bad(
                f"type must be one of {sorted(_TYPES)} or a list of them, got {kind!r}", f"{where}.type"
            )
    for key in _SCHEMA_MAPS:
        if key in schema:
            value = schema[key]
            if not isinstance(value, dict):
                raise bad("must be an object mapping names to schemas", f"{where}.{key}")
            for name, sub in value.items():
                check_schema(sub, f"{where}.{key}.{name}", depth + 1)
    for key in _SCHEMA_ONE:
        if key in schema:
            value = schema[key]
            if key == "items" and isinstance(value, list):  # draft 4 tuple form
                for j, sub in enumerate(value):
                    check_schema(sub, f"{where}.items[{j}]", depth + 1)
            else:
                check_schema(value, f"{where}.{key}", depth + 1)
    for key in _SCHEMA_LISTS:
        if key in schema:
            value = schema[key]
            if not isinstance(value, list) or not value:
                raise bad("must be a non-empty array of schemas", f"{where}.{key}")
            for j, sub in enumerate(value):
                check_schema(sub, f"{where}.{key}[{j}]", depth + 1)
    if "required" in schema:
        required = schema["required"]
        if (
            not isinstance(required, list)
            or not all(isinstance(r, str) for r in required)
            or len(set(required)) != len(required)
        ):
            raise bad("must be an array of unique property names", f"{where}.required")
    if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
        raise bad("must be a non-empty array", f"{where}.enum")
    for key in _NUMBERS:
        if key in schema and (isinstance(schema[key], bool) or not isinstance(schema[key], int | float)):
            raise bad("must be a number", f"{where}.{key}")
    for key in _COUNTS:
        value = schema.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise bad("must be a non-negative integer", f"{where}.{key}")
    for key in _STRINGS:
        if key in schema and not isinstance(schema[key], str):
            raise bad("must be a string", f"{where}.{key}")
    if isinstance(schema.get("pattern"), str):
        try:
            re.compile(schema["pattern"])
        except re.error as e:
            raise bad(f"not a valid regular expression: {e}", f"{where}.pattern") from None


def check_tool_messages(messages: Any) -> None:
    """Every call answered by a ``tool`` message right after it, every ``tool`` message an answer."""
    if not isinstance(messages, list):
        return
    open_at: int | None = None  # the assistant message whose calls are being answered
    pending: dict[str, bool] = {}  # its call ids: answered yet?
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue  # the renderer names the bad shape
        role = message.get("role")
        if role == "tool":
            call_id = message.get("tool_call_id")
            where = f"messages[{i}].tool_call_id"
            if open_at is None:
                raise bad(
                    "a tool message must answer a call of the assistant message before it "
                    "(a message with tool_calls), and none is open here",
                    f"messages[{i}]",
                )
            if not isinstance(call_id, str) or not call_id:
                raise bad("must be the id of the call this message answers", where)
            if call_id not in pending:
                raise bad(
                    f"{call_id!r} matches no call of messages[{open_at}] (its ids: {sorted(pending)})", where
                )
            if pending[call_id]:
                raise bad(f"the call {call_id!r} was already answered", where)
            pending[call_id] = True
            continue
        _close(open_at, pending)
        open_at, pending = None, {}
        calls = message.get("tool_calls") if role == "assistant" else None
        if isinstance(calls, list) and calls:
            for j, call in enumerate(calls):
                call_id = call.get("id") if isinstance(call, dict) else None
                where = f"messages[{i}].tool_calls[{j}].id"
                if not isinstance(call_id, str) or not call_id:
                    raise bad("every call needs an id (the tool message answering it names it)", where)
                if call_id in pending:
                    raise bad(f"{call_id!r} is the id of another call of this message", where)
                pending[call_id] = False
            open_at = i
    _close(open_at, pending)


def _close(open_at: int | None, pending: dict[str, bool]) -> None:
    missing = [call_id for call_id, answered in pending.items() if not answered]
    if open_at is not None and missing:
        raise bad(
            "an assistant message with tool_calls must be followed by a tool message answering each "
            f"call; no answer to {missing}",
            f"messages[{open_at}].tool_calls",
        )


def check_chat_body(body: dict[str, Any], known_fields: Iterable[str] | None) -> None:
    """All of the above for a chat request's JSON body (``known_fields``: the fields the backend
    implements; ``None`` skips the field check)."""
    if known_fields is not None:
        error = unknown_fields_error(body, known_fields)
        if error is not None:
            raise error
    check_tools(body.get("tools"))
    check_tool_messages(body.get("messages"))

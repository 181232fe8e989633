"""The text a forced tool call may continue with, as a character automaton (no torch).

``tool_choice = "required"`` or a named function starts the reply with the parser's opening of a
call (``tool_calls.ToolCallParser.forced_prefix``); from there decoding is constrained so the
reply *is* a call the parser reads: for a named function, JSON arguments valid for its schema, then
the call's close; for ``required``, the name of one of the offered tools, then its arguments, then
the close; then only an end token. ``hf.constrain`` turns this automaton into a mask over the
tokenizer's vocabulary, one state at a time.

What the arguments are held to (a subset of JSON Schema, enough for tool parameters):

- ``type`` ``object`` with ``properties``, ``required`` (all present before ``}``), no key twice,
  and ``additionalProperties: false`` (only the listed keys) or not (any key, its value any JSON);
- ``string``, ``integer`` (no fraction or exponent), ``number``, ``boolean``, ``null``;
- ``array`` with ``items``; ``enum`` and ``const`` (exactly one of the listed values);
- anything else (``anyOf``, a list of types, ``$ref``, formats, lengths): any JSON value.

Every value is strict JSON (no ``NaN``, no trailing commas, valid escapes). Whitespace between
tokens is allowed but at most ``MAX_WHITESPACE`` characters in a row, so a model cannot idle in
whitespace until ``max_tokens``; inside strings anything JSON allows.

A state is an immutable, hashable tuple (``step`` returns a new one, ``None`` when the character
cannot continue), so the token-level masks can be cached per state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

MAX_WHITESPACE = 4
"""Whitespace characters allowed in a row between JSON tokens."""
_WS = " \t\n\r"
_DIGITS = "0123456789"
_HEX = "0123456789abcdefABCDEF"
_ESCAPES = '"\\/bfnrtu'

# Schema node kinds.
ANY, STRING, INTEGER, NUMBER, BOOLEAN, NULL, OBJECT, ARRAY, ENUM = range(9)


@dataclass
class _Node:
    kind: int
    properties: dict[str, int] = field(default_factory=dict)
    required: frozenset[str] = frozenset()
    additional: int | None = None
    """Node of values under keys not in ``properties``; ``None``: such keys are not allowed."""
    items: int = 0
    texts: tuple[str, ...] = ()
    """``ENUM``: the allowed values, as JSON text."""


class CallGrammar:
    """What may follow a forced call opening: ``tools`` maps each allowed function to its
    ``parameters`` schema (``None``: any object); ``named`` is true when the opening already
    wrote the function's name (a named ``tool_choice``: one tool), false for ``required``."""

    def __init__(self, tools: dict[str, dict[str, Any] | None], *, named: bool, close: str) -> None:
        self.nodes: list[_Node] = [_Node(ANY, additional=0)]  # any value: objects take any key
        args = {name: self._compile(schema or {"type": "object"}, top=True) for name, schema in tools.items()}
        self._tail = (("END",), ("L", (close,), ""), ("L", ("}",), ""))
        if named:
            (arguments,) = args.values()
            self.start: tuple[Any, ...] = ((*self._tail, ("V", arguments)), 0)
        else:
            self._heads = {
                f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments":': node
                for name, node in args.items()
            }
            self.start = ((("H", tuple(self._heads), ""),), 0)

    # ------------------------------------------------------------------ schemas

    def _add(self, node: _Node) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def _compile(self, schema: Any, top: bool = False) -> int:
        if not isinstance(schema, dict):
            return 0
        if "const" in schema:
            return self._add(_Node(ENUM, texts=(_json_text(schema["const"]),)))
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return self._add(_Node(ENUM, texts=tuple(dict.fromkeys(_json_text(v) for v in schema["enum"]))))
        kind = schema.get("type", "object" if top or "properties" in schema else None)
        simple = {"string": STRING, "integer": INTEGER, "number": NUMBER, "boolean": BOOLEAN, "null": NULL}
        if kind in simple:
            return self._add(_Node(simple[kind]))
        if kind == "array":
            return self._add(_Node(ARRAY, items=self._compile(schema.get("items"))))
        if kind == "object":
            properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
            required = [r for r in schema.get("required") or [] if isinstance(r, str)]
            extra = schema.get("additionalProperties", True)
            node = _Node(OBJECT, required=frozenset(required))
            index = self._add(node)
            node.properties = {k: self._compile(v) for k, v in properties.items()}
            if extra is False:
                node.additional = None
                # A required key that is not a property could never be written: allow it anyway.
                for name in required:
                    node.properties.setdefault(name, 0)
            else:
                node.additional = self._compile(extra) if isinstance(extra, dict) else 0
            return index
        return 0

    # ------------------------------------------------------------------ the automaton

    def done(self, state: tuple[Any, ...]) -> bool:
        """Whether the call is complete (only an end token may follow)."""
        return state[0][-1] == ("END",)

    def feed(self, state: tuple[Any, ...] | None, text: str) -> tuple[Any, ...] | None:
        for char in text:
            if state is None:
                return None
            state = self.step(state, char)
        return state

    def step(self, state: tuple[Any, ...], char: str) -> tuple[Any, ...] | None:
        """The state after ``char``, or ``None`` if the call cannot continue with it."""
        stack, ws = state
        stack = list(stack)
        while True:
            frame = stack[-1]
            kind = frame[0]
            if char in _WS and kind in ("V", "O", "A") and not (kind == "O" and frame[2] == "key"):
                if ws >= MAX_WHITESPACE:
                    return None
                return (tuple(stack), ws + 1)
            result = self._frame_step(stack, frame, char)
            if result is _REFEED:
                continue
            if result is None:
                return None
            return (tuple(stack), 0)

    def _frame_step(self, stack: list[Any], frame: tuple[Any, ...], c: str) -> object:
        kind = frame[0]
        if kind == "END":
            return None
        if kind in ("L", "H"):
            texts, typed = frame[1], frame[2] + c
            if any(t.startswith(typed) for t in texts):
                if typed in texts and not any(len(t) > len(typed) and t.startswith(typed) for t in texts):
                    stack.pop()
                    if kind == "H":
                        stack.extend((*self._tail, ("V", self._heads[typed])))
                else:
                    stack[-1] = (kind, texts, typed)
                return True
            if frame[2] in texts:  # a complete value followed by something else
                stack.pop()
                return _REFEED
            return None
        if kind == "V":
            return self._value_start(stack, frame[1], c)
        if kind == "S":  # ("S", escape, key_typed or None): inside a string
            return self._string(stack, frame, c)
        if kind == "N":
            return self._number(stack, frame, c)
        if kind == "O":
            return self._object(stack, frame, c)
        if kind == "A":
            return self._array(stack, frame, c)
        raise AssertionError(kind)

    def _value_start(self, stack: list[Any], index: int, c: str) -> object:
        node = self.nodes[index]
        stack.pop()
        k = node.kind
        if k == ENUM:
            stack.append(("L", node.texts, ""))
            return _REFEED
        if c == '"' and k in (ANY, STRING):
            stack.append(("S", 0, None))
            return True
        if c == "{" and k in (ANY, OBJECT):
            stack.append(("O", index, "start", frozenset(), 0))
            return True
        if c == "[" and k in (ANY, ARRAY):
            stack.append(("A", node.items if k == ARRAY else 0, "start"))
            return True
        if (c == "-" or c in _DIGITS) and k in (ANY, INTEGER, NUMBER):
            stack.append(("N", k == INTEGER, "start"))
            return _REFEED
        literals = {"t": ("true", BOOLEAN), "f": ("false", BOOLEAN), "n": ("null", NULL)}
        if c in literals and k in (ANY, literals[c][1]):
            stack.append(("L", (literals[c][0],), ""))
            return _REFEED
        return None

    def _string(self, stack: list[Any], frame: tuple[Any, ...], c: str) -> object:
        _, escape, typed = frame
        if escape == 0:
            if c == '"':
                stack.pop()
                if typed is not None:  # a key: the object learns its name
                    return self._key_done(stack, typed)
                return True
            if ord(c) < 0x20:
                return None
            escape = 1 if c == "\\" else 0
        elif escape == 1:
            if c not in _ESCAPES:
                return None
            escape = 2 if c == "u" else 0
        else:
            if c not in _HEX:
                return None
            escape = 0 if escape == 5 else escape + 1
        if typed is not None:
            typed += c
            if not self._key_possible(stack[-2], typed, escape == 0):
                return None
        stack[-1] = ("S", escape, typed)
        return True

    def _key_possible(self, obj: tuple[Any, ...], typed: str, complete_char: bool) -> bool:
        node = self.nodes[obj[1]]
        if node.additional is not None:
            return True
        seen = obj[3]
        return any(
            name not in seen and json.dumps(name, ensure_ascii=False)[1:-1].startswith(typed)
            for name in node.properties
        )

    def _key_done(self, stack: list[Any], typed: str) -> object:
        _, index, _, seen, _ = stack[-1]
        node = self.nodes[index]
        try:
            key = json.loads(f'"{typed}"')
        except ValueError:
            return None
        if key in seen:
            return None
        if key in node.properties:
            value = node.properties[key]
        elif node.additional is not None:
            value = node.additional
        else:
            return None
        stack[-1] = ("O", index, "colon", seen | {key}, value)
        return True

    def _number(self, stack: list[Any], frame: tuple[Any, ...], c: str) -> object:
        _, integer, phase = frame
        nxt = None
        if phase == "start":
            nxt = "minus" if c == "-" else "zero" if c == "0" else "int" if c in _DIGITS else None
        elif phase == "minus":
            nxt = "zero" if c == "0" else "int" if c in _DIGITS else None
        elif phase in ("zero", "int"):
            if c in _DIGITS and phase == "int":
                nxt = "int"
            elif c == "." and not integer:
                nxt = "dot"
            elif c in "eE" and not integer:
                nxt = "e"
        elif phase in ("dot", "frac"):
            nxt = "frac" if c in _DIGITS else ("e" if c in "eE" and phase == "frac" else None)
        elif phase == "e":
            nxt = "esign" if c in "+-" else "exp" if c in _DIGITS else None
        elif phase in ("esign", "exp"):
            nxt = "exp" if c in _DIGITS else None
        if nxt is not None:
            stack[-1] = ("N", integer, nxt)
            return True
        if phase in ("zero", "int", "frac", "exp"):  # the number ended: the parent reads ``c``
            stack.pop()
            return _REFEED
        return None

    def _object(self, stack: list[Any], frame: tuple[Any, ...], c: str) -> object:
        _, index, phase, seen, value = frame
        node = self.nodes[index]
        if phase in ("start", "comma") and c == '"':
            stack[-1] = ("O", index, "key", seen, 0)
            stack.append(("S", 0, ""))
            return True if self._key_possible(stack[-2], "", True) else None
        if phase in ("start", "after") and c == "}" and node.required <= seen:
            stack.pop()
            return True
        if phase == "colon" and c == ":":
            stack[-1] = ("O", index, "after", seen, 0)
            stack.append(("V", value))
            return True
        if phase == "after" and c == "," and (node.additional is not None or set(node.properties) - seen):
            stack[-1] = ("O", index, "comma", seen, 0)
            return True
        return None

    def _array(self, stack: list[Any], frame: tuple[Any, ...], c: str) -> object:
        _, items, phase = frame
        if phase in ("start", "after") and c == "]":
            stack.pop()
            return True
        if phase == "after" and c == ",":
            stack[-1] = ("A", items, "comma")
            return True
        if phase in ("start", "comma"):
            stack[-1] = ("A", items, "after")
            stack.append(("V", items))
            return _REFEED
        return None


_REFEED = object()
"""A frame finished without consuming the character: its parent reads it."""


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


class CallSpec:
    """What a forced call must be (hashable by ``key``): the offered functions' schemas,
    whether the opening named one, and the parser's closing marker."""

    def __init__(self, tools: dict[str, dict[str, Any] | None], *, named: bool, close: str) -> None:
        self.tools, self.named, self.close = tools, named, close
        self.key = json.dumps([tools, named, close], sort_keys=True)

    def grammar(self) -> CallGrammar:
        return CallGrammar(self.tools, named=self.named, close=self.close)

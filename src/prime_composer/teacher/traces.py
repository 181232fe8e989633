"""Frozen agentic traces: the JSONL schema, line-by-line validation, and the verifiers importer.

One trace per line::

    {"id": "t-17",                                   # optional; default: a hash of the content
     "task": "Make the tests in calc/ pass.",        # free-form: a string or an object
     "tools": [{"name": "bash", "description": "...", "parameters": {...}}],   # optional
     "turns": [
       {"role": "system", "content": "You are a coding agent."},
       {"role": "user", "content": "Make the tests in calc/ pass."},
       {"role": "assistant", "content": "",
        "tool_calls": [{"id": "c1", "name": "bash", "arguments": {"command": "pytest -q"}}],
        "logprobs": [-0.01, -0.2, ...]},             # optional: the action's sampled token logprobs
       {"role": "tool", "tool_call_id": "c1", "name": "bash", "content": "1 failed", "exit_code": 1},
       ...],
     "reward": 0.0,                                  # final reward, optional
     "info": {...}}                                  # anything else, kept as it is

``arguments`` may be an object or the JSON string a model emitted. An assistant turn may also
carry ``token_ids`` (the action's tokens as the student sampled them) and ``prompt_token_ids`` (the
exact context it saw): the run's own rollouts have them, and then the pair's rejected side and
context use them instead of re-rendering text. A *step* is an assistant turn; the *state* at a step
is the task and every turn before it.

A line that is not JSON, misses a field, has a wrong type, an unknown key, too many turns or a
huge turn is rejected with a message naming the file, the line and the field; the other lines
still load (``read_trace_file``). Lines are read with a length cap, so a runaway line cannot take
the process's memory.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from prime_composer.config.teacher import TraceSourceConfig

TRACE_ID_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.:@+=-]*$"
"""A trace id: letters, digits and ``_ . : @ + = -`` (no ``/``, no control characters, not starting
with a dot); verifiers' uuid hex ids and ``t-17`` style names fit."""

TokenId = Annotated[int, Field(ge=0, lt=2**31)]
ExitCode = Annotated[int, Field(ge=-(2**31), lt=2**31)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ToolCall(_Strict):
    """One tool call of an assistant turn."""

    name: str = Field(min_length=1)
    arguments: dict[str, Any] | str = Field(default_factory=dict)
    """An object, or the raw string a model emitted (parsed as JSON when it is JSON)."""
    id: str | None = None


class Turn(_Strict):
    """One message of a trace."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    """Assistant turns only."""
    tool_call_id: str | None = None
    """Tool turns only: which call this is the result of."""
    name: str | None = None
    """Tool turns only: the tool's name."""
    exit_code: ExitCode | None = None
    """Tool turns only: the command's exit status when the tool reports one."""
    is_error: bool | None = None
    """Tool turns only: the tool reported a failure."""
    logprobs: list[float] | None = None
    """Assistant turns only: logprobs of the sampled action tokens (the student's uncertainty)."""
    token_ids: list[TokenId] | None = None
    """Assistant turns only: the action's tokens as sampled (with the end-of-turn token)."""
    prompt_token_ids: list[TokenId] | None = None
    """Assistant turns only: the exact context token ids the student was given."""
    finish_reason: str | None = None
    """Assistant turns only: why sampling stopped, when known (``length``: cut at the token budget;
    a pair's rejected side from such a turn is its tokens as sampled, with no end token added)."""

    @model_validator(mode="after")
    def _check_role_fields(self) -> Self:
        if self.role != "assistant":
            for field in ("tool_calls", "logprobs", "token_ids", "prompt_token_ids", "finish_reason"):
                if getattr(self, field):
                    raise ValueError(
                        f"{field} is only allowed on assistant turns (this one is {self.role!r})"
                    )
        if self.role != "tool":
            for field in ("tool_call_id", "name", "exit_code", "is_error"):
                if getattr(self, field) is not None:
                    raise ValueError(f"{field} is only allowed on tool turns (this one is {self.role!r})")
        return self

    def state_dict(self) -> dict[str, Any]:
        """What a teacher sees of this turn (no token ids or logprobs): the part hashed into a state."""
        return self.model_dump(
            mode="json",
            exclude={"logprobs", "token_ids", "prompt_token_ids", "finish_reason"},
            exclude_defaults=True,
        )


class TraceRecord(_Strict):
    """One trace, as one JSONL line."""

    id: str | None = Field(default=None, min_length=1, max_length=200, pattern=TRACE_ID_PATTERN)
    task: str | dict[str, Any] = ""
    tools: list[dict[str, Any]] = Field(default_factory=list)
    turns: list[Turn] = Field(min_length=1)
    reward: float | None = None
    info: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_steps(self) -> Self:
        if not any(t.role == "assistant" for t in self.turns):
            raise ValueError("turns has no assistant turn, so there is no step to replay")
        return self


@dataclass(frozen=True)
class Trace:
    """A validated trace with its id (given, or the hash of its content)."""

    trace_id: str
    record: TraceRecord
    source: str
    """Where it came from (``file.jsonl:17``, ``http``, ...)."""

    @property
    def turns(self) -> list[Turn]:
        return self.record.turns

    @property
    def step_indices(self) -> list[int]:
        """Indices into ``turns`` of the assistant turns (the steps)."""
        return [i for i, t in enumerate(self.record.turns) if t.role == "assistant"]

    def state_hash(self, turn_index: int) -> str:
        """Hash of what a teacher sees before ``turns[turn_index]``: task, tools and earlier turns."""
        state = {
            "task": self.record.task,
            "tools": self.record.tools,
            "turns": [t.state_dict() for t in self.record.turns[:turn_index]],
        }
        return _sha256(state)

    def to_json(self) -> str:
        """The canonical JSON line stored for this trace (id filled in)."""
        return json.dumps(
            self.record.model_copy(update={"id": self.trace_id}).model_dump(mode="json", exclude_none=True),
            sort_keys=True,
            separators=(",", ":"),
        )


class TraceError(ValueError):
    """A trace that cannot be used; the message names where it came from and what is wrong."""


def _sha256(value: Any) -> str:
    blob = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` (parsed JSON) has objects or arrays nested more than ``limit`` deep (the
    outermost one is depth 1); without recursion, so any depth is safe to ask about."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def parse_trace(data: Any, source: str, limits: TraceSourceConfig) -> Trace:
    """Validate one trace object; ``TraceError`` with a one-line message naming ``source``."""
    if not isinstance(data, dict):
        raise TraceError(f"{source}: a trace must be a JSON object, got {type(data).__name__}")
    if nested_deeper_than(data, limits.max_json_depth):
        raise TraceError(f"{source}: nested deeper than traces.max_json_depth = {limits.max_json_depth}")
    try:
        record = TraceRecord.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(trace)"
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise TraceError(f"{source}: {where}: {first['msg']}{more}") from None
    if len(record.turns) > limits.max_turns:
        raise TraceError(
            f"{source}: {len(record.turns)} turns, more than traces.max_turns = {limits.max_turns}"
        )
    for i, turn in enumerate(record.turns):
        if len(turn.content) > limits.max_turn_chars:
            raise TraceError(
                f"{source}: turns.{i}.content has {len(turn.content)} characters, more than "
                f"traces.max_turn_chars = {limits.max_turn_chars}"
            )
    trace_id = record.id or _sha256(record.model_dump(mode="json", exclude_none=True))[:24]
    return Trace(trace_id=trace_id, record=record, source=source)


def iter_lines(path: Path, max_line_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """``(line number, bytes)`` for each non-blank line; ``bytes`` is None for a line longer than
    ``max_line_bytes``, which is skipped without ever being held in memory whole."""
    with open(path, "rb") as f:
        number = 0
        while True:
            line = f.readline(max_line_bytes + 1)
            if not line:
                return
            number += 1
            if len(line) > max_line_bytes and not line.endswith(b"\n"):
                while line and not line.endswith(b"\n"):  # skip the rest of the runaway line
                    line = f.readline(1 << 20)
                yield number, None
                continue
            if line.strip():
                yield number, line


@dataclass
class ImportResult:
    """What reading one file gave: valid traces, and one message per rejected line."""

    traces: list[tuple[int, Trace]]
    """``(line number, trace)``."""
    errors: list[tuple[int, str]]
    """``(line number, message)``."""


def read_trace_file(path: Path, limits: TraceSourceConfig) -> ImportResult:
    """Every valid trace of a JSONL file in this module's schema; bad lines become errors."""
    return _read(path, limits, lambda data, source: [parse_trace(data, source, limits)])


def read_verifiers_file(path: Path, limits: TraceSourceConfig) -> ImportResult:
    """Traces of a verifiers ``traces.jsonl`` (one rollout episode per line, ``Episode`` of
    ``verifiers.v1``); each trace of an episode becomes one trace here (see ``from_verifiers``)."""
    return _read(path, limits, lambda data, source: from_verifiers_episode(data, source, limits))


def _read(path: Path, limits: TraceSourceConfig, convert: Any) -> ImportResult:
    result = ImportResult(traces=[], errors=[])
    for number, line in iter_lines(path, limits.max_line_bytes):
        source = f"{path}:{number}"
        if line is None:
            result.errors.append(
                (number, f"{source}: the line is longer than traces.max_line_bytes = {limits.max_line_bytes}")
            )
            continue
        try:
            data = json.loads(line)
        except RecursionError:
            result.errors.append(
                (number, f"{source}: nested deeper than traces.max_json_depth = {limits.max_json_depth}")
            )
            continue
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, or an integer of > 4300 digits
            result.errors.append((number, f"{source}: not valid JSON ({e})"))
            continue
        try:
            result.traces.extend((number, trace) for trace in convert(data, source))
        except TraceError as e:
            result.errors.append((number, str(e)))
    return result


# ------------------------------------------------------------------------------------ verifiers


def from_verifiers_episode(episode: Any, source: str, limits: TraceSourceConfig) -> list[Trace]:
    """The traces of one verifiers episode (a parsed line of its ``traces.jsonl``).

    Per trace: the message graph's main branch (the last node and its ``parent`` chain) becomes the
    turns; assistant nodes the model sampled keep their sampled tokens (``mask``) as ``token_ids``,
    their ``logprobs``, and the tokens of every node before them (plus their own template scaffold)
    as ``prompt_token_ids``; the reward is the weighted sum of ``rewards``. Read as plain JSON, so
    any verifiers version with this layout imports without loading verifiers.
    """
    if not isinstance(episode, dict) or not isinstance(episode.get("traces"), list):
        raise TraceError(f"{source}: not a verifiers episode (an object with a 'traces' list)")
    traces = []
    for k, raw in enumerate(episode["traces"]):
        where = f"{source} trace {k}"
        if not isinstance(raw, dict) or not isinstance(raw.get("nodes"), list) or not raw["nodes"]:
            raise TraceError(f"{where}: no message nodes")
        try:
            record = _verifiers_record(raw, episode)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise TraceError(f"{where}: unexpected layout ({type(e).__name__}: {e})") from None
        traces.append(parse_trace(record, where, limits))
    return traces


def _main_branch(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    path, seen = [], set()
    index: int | None = len(nodes) - 1
    while index is not None:
        if index in seen or not 0 <= index < len(nodes):
            raise ValueError(f"node parent chain is broken at {index}")
        seen.add(index)
        path.append(nodes[index])
        index = nodes[index].get("parent")
    return path[::-1]


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


def _verifiers_record(raw: dict[str, Any], episode: dict[str, Any]) -> dict[str, Any]:
    turns: list[dict[str, Any]] = []
    tokens_before: list[int] = []
    have_tokens = True
    for node in _main_branch(raw["nodes"]):
        message = node["message"]
        role = message["role"]
        turn: dict[str, Any] = {"role": role, "content": _text(message.get("content"))}
        node_ids = [int(t) for t in node.get("token_ids") or []]
        mask = [bool(m) for m in node.get("mask") or []]
        if role == "assistant":
            calls = message.get("tool_calls") or []
            turn["tool_calls"] = [
                {"id": c.get("id"), "name": c["name"], "arguments": c.get("arguments", {})} for c in calls
            ]
            if node.get("sampled") and node.get("logprobs"):
                turn["logprobs"] = [float(x) for x in node["logprobs"]]
            # Exact tokens only in the canonical layout: template scaffold, then the sampled span.
            start = mask.index(True) if True in mask else len(mask)
            exact = have_tokens and len(mask) == len(node_ids) and start < len(mask) and all(mask[start:])
            if node.get("sampled") and exact:
                turn["prompt_token_ids"] = tokens_before + node_ids[:start]
                turn["token_ids"] = node_ids[start:]
        elif role == "tool":
            turn["tool_call_id"] = message.get("tool_call_id")
            if message.get("name"):
                turn["name"] = message["name"]
        have_tokens = have_tokens and bool(node_ids)
        tokens_before += node_ids
        turns.append(turn)
    rewards = raw.get("rewards") or {}
    reward = sum(float(r["score"]) * float(r.get("weight", 1.0)) for r in rewards.values() if r is not None)
    task = raw.get("task") or episode.get("task") or {}
    return {
        "id": raw.get("id"),
        "task": task.get("data", task) if isinstance(task, dict) else task,
        "tools": [t for t in raw.get("tools") or [] if isinstance(t, dict)],
        "turns": turns,
        "reward": reward if rewards else None,
        "info": {"verifiers_episode": episode.get("id"), "ok": raw.get("ok")},
    }

"""How run results read to the model, and the argument checks of tool calls (no processes)."""

from __future__ import annotations

import pytest

from prime_composer.sandbox.files import ToolError
from prime_composer.sandbox.sandbox import RunResult
from prime_composer.sandbox.tools import Tool, _schema, _validate, format_run


def result(**fields: object) -> RunResult:
    base: dict[str, object] = {"exit_code": 0, "signal": None, "stdout": "", "stderr": "", "duration_s": 0.1}
    base.update(fields)
    return RunResult(**base)  # type: ignore[arg-type]


def test_format_run_states_how_the_command_ended() -> None:
    assert format_run(result(stdout="hi\n"), 30) == "Exit code: 0\nstdout:\nhi"
    assert format_run(result(exit_code=2, stderr="bad\n"), 30) == "Exit code: 2\nstderr:\nbad"
    assert (
        format_run(result(exit_code=None, signal="SIGSEGV"), 30) == "Killed by signal SIGSEGV.\n(no output)"
    )
    timed_out = result(
        exit_code=None,
        signal="SIGKILL",
        timed_out=True,
        killed_by="timeout",
        limits_hit=("timeout",),
        stdout="partial\n",
    )
    assert format_run(timed_out, 7.5) == (
        "Error: timed out after 7.5 s; the command and every process it started were killed.\nstdout:\npartial"
    )
    memory = result(exit_code=1, stderr="MemoryError\n", limits_hit=("memory", "output"))
    assert (
        format_run(memory, 30)
        == "Exit code: 1\nIt ran into the sandbox's memory limit.\nstderr:\nMemoryError"
    )


TOOL = Tool(
    "read_file",
    "",
    _schema(["path"], path=("string", ""), start_line=("integer", "")),
    lambda **kwargs: ("", None),
)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ([], "must be a JSON object"),
        ({}, "needs the argument 'path'"),
        ({"path": "a", "mode": "r"}, "no argument 'mode'"),
        ({"path": 3}, "'path' of read_file must be a string"),
        ({"path": "a", "start_line": True}, "must be an integer"),
        ({"path": "a", "start_line": 1.5}, "must be an integer"),
    ],
)
def test_arguments_that_do_not_fit_the_schema(arguments: object, message: str) -> None:
    with pytest.raises(ToolError, match=message) as info:
        _validate(TOOL, arguments)
    assert info.value.kind == "invalid_arguments"


def test_null_optional_arguments_are_dropped() -> None:
    arguments = {"path": "a", "start_line": None}
    _validate(TOOL, arguments)
    assert arguments == {"path": "a"}
    with pytest.raises(ToolError, match="must be a string"):
        _validate(TOOL, {"path": None})


def test_arguments_may_come_parsed_or_malformed() -> None:
    from prime_composer.sandbox.tools import _as_json

    assert _as_json(None) == "" and _as_json('{"a": 1}') == '{"a": 1}'
    assert _as_json({"path": "x"}) == '{"path": "x"}'
    assert _as_json(["x"]) == '["x"]'
    assert _as_json({"x": object()}).startswith("{'x': <object")


EXTERNAL = Tool(
    "lookup",
    "An MCP-style tool with a richer schema.",
    {
        "type": "object",
        "properties": {
            "query": {"type": "string"},
            "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "score": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "exact": {"type": "boolean"},
        },
        "required": ["query"],
        "additionalProperties": False,
    },
    lambda **_: ("", None),
    external=True,
)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"query": "x", "limit": None, "score": 2, "tags": ["a"], "exact": True}, None),
        ({"query": "x", "score": 0.5}, None),
        ({"query": "x", "score": None}, None),  # null for an optional argument: left out
        ({"limit": 3}, "lookup needs the argument 'query'"),
        ({"query": "x", "page": 2}, "lookup has no argument 'page'"),
        ({"query": "x", "score": True}, "argument 'score' of lookup must be of type number, got true"),
        ({"query": "x", "limit": "3"}, "argument 'limit' of lookup must be of type integer or null"),
        ({"query": "x", "tags": "a"}, "argument 'tags' of lookup must be of type array"),
    ],
)
def test_external_tools_are_checked_against_their_own_schema(args: dict, message: str | None) -> None:
    if message is None:
        _validate(EXTERNAL, dict(args))
        return
    with pytest.raises(ToolError, match=message.replace("(", r"\(")) as error:
        _validate(EXTERNAL, dict(args))
    assert error.value.kind == "invalid_arguments"

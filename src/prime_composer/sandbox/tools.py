"""Coding tools on a sandboxed workspace, in the OpenAI ``tools`` format.

``Toolset`` maps one tool call of the model (a name and a JSON argument string) to a
``ToolResult``: the text the model gets back as the tool message, and a ``ToolCallRecord`` for the
trace. A call that fails for any reason (unknown tool, arguments that are not JSON or do not fit
the schema, a path outside the workspace, a timeout, a crash, output too large) still returns a
result: an ``Error: ...`` text the model can act on, and a record whose ``error`` names the kind
of failure. Nothing a model sends can raise out of ``call``.

The tools (an environment picks which ones with ``ToolsConfig.enabled``)::

    list_files(path=".")                        paths under a folder, recursively
    read_file(path, start_line=1, end_line)     numbered lines, at most max_read_lines a call
    search(pattern, path=".", glob)             grep -P over the workspace, in the sandbox
    write_file(path, content)                   create or overwrite a file
    edit_file(path, old_string, new_string)     replace the one exact occurrence of old_string
    run(command)                                bash -c in the sandbox (SandboxConfig.limits)
    run_tests()                                 the task's test command (SandboxConfig.test_limits)

The file tools run in this process (``files.py`` explains why that is safe); ``search``, ``run``
and ``run_tests`` run in the sandbox.

More tools (an MCP server's, ``orchestrator/mcp_tools.py``) come in as ``Tool``s through
``extra_tools``: they get the same dispatch, argument checks (against their own JSON schema),
result cap, records and one-call-at-a-time lock as the built-in ones.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from prime_composer.config.sandbox import ToolsConfig
from prime_composer.sandbox import files
from prime_composer.sandbox.files import ToolError
from prime_composer.sandbox.output import truncate_middle
from prime_composer.sandbox.sandbox import RunResult, Sandbox, SandboxError
from prime_composer.sandbox.workspace import Workspace

logger = logging.getLogger(__name__)

MAX_MATCH_LINE_CHARS = 300
"""A matching line longer than this is cut in ``search`` results (minified files)."""


@dataclass
class ToolCallRecord:
    """What one tool call did, for the rollout's trace (JSON-serializable with ``to_dict``)."""

    name: str
    arguments: str
    """The argument string exactly as the model sent it."""
    ok: bool
    """The tool did what was asked (a command that ran and exited non-zero is ok; one that timed out is not)."""
    error: str | None = None
    """Kind of failure: ``unknown_tool``, ``invalid_json``, ``invalid_arguments``,
    ``path_outside_workspace``, ``not_found``, ``edit_no_match``, ``edit_ambiguous``, ``timeout``,
    ``killed``, ``sandbox_error``, ``internal_error``, ..."""
    duration_s: float = 0.0
    result_bytes: int = 0
    """Size of the text returned to the model."""
    truncated: bool = False
    """The result (or the command's output) was cut to its limit."""
    run: dict[str, Any] | None = None
    """``RunResult.to_dict()`` of the tools that run a command."""
    external: bool = False
    """The tool is an external one (``Tool.external``: an MCP server's), not the sandbox's."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ToolResult:
    content: str
    """The tool message for the model."""
    record: ToolCallRecord


@dataclass(frozen=True)
class Tool:
    """One tool: its definition for the model and the handler a call runs (``handler(**args)``
    returns the text for the model and the sandbox run, if it made one; it raises ``ToolError``
    for a failure the model should see)."""

    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments: an object of string / integer properties for the built-in
    tools; any object schema for ``external`` ones."""
    handler: Callable[..., tuple[str, RunResult | None]]
    external: bool = False
    """Arguments are checked against the schema's top level only (required, unknown and the JSON
    types of the properties); the tool checks the rest itself."""

    def definition(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass
class _Outcome:
    content: str
    run: RunResult | None = None
    error: str | None = None
    truncated: bool = field(default=False)


def _schema(required: Sequence[str] = (), **properties: tuple[str, str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {name: {"type": kind, "description": doc} for name, (kind, doc) in properties.items()},
        "required": list(required),
        "additionalProperties": False,
    }


class Toolset:
    """The tools one episode's model can call on its workspace.

    ``definitions()`` goes into the chat request's ``tools``; each tool call of the reply goes
    through ``call`` (or ``call_async``); ``records`` keeps every call's record in order.
    """

    def __init__(
        self,
        sandbox: Sandbox,
        workspace: Workspace,
        config: ToolsConfig | None = None,
        *,
        test_command: Sequence[str] | str | None = None,
        extra_tools: Sequence[Tool] = (),
    ) -> None:
        self.sandbox = sandbox
        self.workspace = workspace
        self.config = config = config or ToolsConfig()
        self.test_command = test_command
        self.records: list[ToolCallRecord] = []
        self._lock = threading.Lock()
        if "run_tests" in config.enabled and not test_command:
            raise ValueError("tools: run_tests is enabled but the task has no test command")
        tools = {tool.name: tool for tool in self._all_tools()}
        self.tools: dict[str, Tool] = {name: tools[name] for name in config.enabled}
        for tool in extra_tools:
            if tool.name in self.tools:
                raise ValueError(
                    f"tools: two tools are named {tool.name!r}; offer only one of them (restrict an "
                    "MCP server's tools with its `tools` list, or drop the sandbox tool from the task)"
                )
            self.tools[tool.name] = tool

    def definitions(self) -> list[dict[str, Any]]:
        """The enabled tools in the OpenAI chat-completions ``tools`` format."""
        return [tool.definition() for tool in self.tools.values()]

    def call(self, name: str, arguments: str | dict[str, Any] | None) -> ToolResult:
        """Run one tool call; never raises for anything in ``name`` or ``arguments``.

        ``arguments`` is the JSON string of the model's tool call (``function.arguments``); an
        already parsed object is accepted too.
        """
        start = time.monotonic()
        arguments = _as_json(arguments)
        # One call at a time per workspace, also when a reply holds several tool calls run
        # concurrently: the file tools rely on no sandboxed process running while they work.
        with self._lock:
            outcome = self._dispatch(str(name), arguments)
        tool = self.tools.get(str(name))
        content, cut = truncate_middle(outcome.content, self.config.max_result_bytes)
        run = outcome.run
        record = ToolCallRecord(
            name=name,
            arguments=arguments,
            ok=outcome.error is None,
            error=outcome.error,
            duration_s=time.monotonic() - start,
            result_bytes=len(content.encode()),
            truncated=cut or outcome.truncated or (run is not None and "output" in run.limits_hit),
            run=run.to_dict() if run is not None else None,
            external=tool is not None and tool.external,
        )
        self.records.append(record)
        return ToolResult(content, record)

    async def call_async(self, name: str, arguments: str | dict[str, Any] | None) -> ToolResult:
        """``call`` on the sandbox's thread pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.sandbox.executor, self.call, name, arguments)

    # -- dispatch -------------------------------------------------------------------------

    def _dispatch(self, name: str, arguments: str) -> _Outcome:
        tool = self.tools.get(name)
        if tool is None:
            available = ", ".join(self.tools) or "none"
            return _Outcome(
                f"Error: there is no tool named {name!r}. Available tools: {available}.", error="unknown_tool"
            )
        try:
            args = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            return _Outcome(
                f"Error: the arguments of {name} are not valid JSON ({e.msg} at position {e.pos}); "
                'send a JSON object such as {"path": "README.md"}.',
                error="invalid_json",
            )
        try:
            _validate(tool, args)
            text, run = tool.handler(**args)
        except ToolError as e:
            return _Outcome(f"Error: {e}", error=e.kind)
        except SandboxError as e:
            logger.warning("tool %s: sandbox failure: %s", name, e)
            return _Outcome(
                f"Error: the sandbox failed to run the tool ({e}); this was not your fault.",
                error="sandbox_error",
            )
        except Exception as e:
            logger.exception("tool %s crashed on arguments %r", name, arguments[:200])
            return _Outcome(
                f"Error: the tool {name} failed ({type(e).__name__}: {e}).", error="internal_error"
            )
        error = None
        if run is not None and run.timed_out:
            error = "timeout"
        elif run is not None and run.killed_by is not None:
            error = "killed"
        return _Outcome(text, run=run, error=error)

    # -- the tools ------------------------------------------------------------------------

    def _all_tools(self) -> list[Tool]:
        cfg, limits, test_limits = self.config, self.sandbox.config.limits, self.sandbox.config.test_limits
        limit_note = f"Results longer than {cfg.max_result_bytes} bytes are cut in the middle."
        return [
            Tool(
                "list_files",
                f"List the files and folders under a folder of the workspace, recursively (at most "
                f"{cfg.max_list_entries} entries; folders end with '/').",
                _schema(path=("string", "Folder relative to the workspace root; default '.'.")),
                self._list_files,
            ),
            Tool(
                "read_file",
                f"Read a text file with line numbers (at most {cfg.max_read_lines} lines per call; page "
                "with start_line). The numbers are not part of the file.",
                _schema(
                    ["path"],
                    path=("string", "File relative to the workspace root."),
                    start_line=("integer", "First line to show, from 1; default 1."),
                    end_line=("integer", "Last line to show (inclusive); default: the end of the file."),
                ),
                self._read_file,
            ),
            Tool(
                "search",
                f"Search file contents with a Perl-compatible regular expression (grep -P); prints "
                f"path:line:text for each matching line, at most {cfg.max_search_matches}.",
                _schema(
                    ["pattern"],
                    pattern=("string", "Regular expression, e.g. 'def \\w+_total'."),
                    path=("string", "File or folder to search, relative to the workspace root; default '.'."),
                    glob=("string", "Only search files whose name matches this glob, e.g. '*.py'."),
                ),
                self._search,
            ),
            Tool(
                "write_file",
                "Create a file, or replace all of an existing file's content; missing folders are created.",
                _schema(
                    ["path", "content"],
                    path=("string", "File relative to the workspace root."),
                    content=("string", "The complete new content of the file."),
                ),
                self._write_file,
            ),
            Tool(
                "edit_file",
                "Replace one exact occurrence of old_string in a file with new_string. old_string must "
                "appear exactly once (whitespace and indentation included); add surrounding lines to "
                "make it unique.",
                _schema(
                    ["path", "old_string", "new_string"],
                    path=("string", "File relative to the workspace root."),
                    old_string=("string", "The exact text to replace."),
                    new_string=("string", "The text to put in its place."),
                ),
                self._edit_file,
            ),
            Tool(
                "run",
                f"Run a bash command in the workspace (no network; killed after {limits.timeout_s:g} s). "
                f"Returns the exit code, stdout and stderr. {limit_note}",
                _schema(["command"], command=("string", "The bash command line.")),
                self._run,
            ),
            Tool(
                "run_tests",
                f"Run the task's tests (killed after {test_limits.timeout_s:g} s) and return their "
                f"output. {limit_note}",
                _schema(),
                self._run_tests,
            ),
        ]

    def _list_files(self, path: str = ".") -> tuple[str, None]:
        cfg = self.config
        return files.list_files(
            self.workspace, path, max_entries=cfg.max_list_entries, skip_dirs=cfg.list_skip_dirs
        ), None

    def _read_file(self, path: str, start_line: int = 1, end_line: int | None = None) -> tuple[str, None]:
        return files.read_file(
            self.workspace, path, start_line, end_line, max_lines=self.config.max_read_lines
        ), None

    def _write_file(self, path: str, content: str) -> tuple[str, None]:
        return files.write_file(self.workspace, path, content), None

    def _edit_file(self, path: str, old_string: str, new_string: str) -> tuple[str, None]:
        return files.edit_file(self.workspace, path, old_string, new_string), None

    def _search(self, pattern: str, path: str = ".", glob: str | None = None) -> tuple[str, RunResult]:
        target = files.resolve(self.workspace, path)
        argv = ["grep", "-rnIP", "--color=never"]
        argv += [f"--exclude-dir={name}" for name in self.config.list_skip_dirs]
        if glob:
            argv.append(f"--include={glob}")
        argv += ["-e", pattern]
        if target != self.workspace.path:  # without a path, grep -r searches "." and omits the "./"
            argv += ["--", self.workspace.relative(target)]
        result = self.sandbox.run(self.workspace, argv)
        if result.timed_out or result.killed_by is not None:
            return format_run(result, self.sandbox.config.limits.timeout_s), result
        if result.exit_code == 1:
            return "No matches.", result
        if result.exit_code != 0:
            raise ToolError(
                "invalid_arguments", f"search failed: {result.stderr.strip() or result.exit_code}"
            )
        lines = result.stdout.splitlines()
        shown = [
            line if len(line) <= MAX_MATCH_LINE_CHARS else line[:MAX_MATCH_LINE_CHARS] + " [line cut]"
            for line in lines[: self.config.max_search_matches]
        ]
        if len(lines) > self.config.max_search_matches or "output" in result.limits_hit:
            shown.append(
                f"[... more matches not shown (limit {self.config.max_search_matches}); narrow the pattern or path]"
            )
        return "\n".join(shown), result

    def _run(self, command: str) -> tuple[str, RunResult]:
        result = self.sandbox.run(self.workspace, command)
        return format_run(result, self.sandbox.config.limits.timeout_s), result

    def _run_tests(self) -> tuple[str, RunResult]:
        assert self.test_command is not None
        limits = self.sandbox.config.test_limits
        result = self.sandbox.run(self.workspace, self.test_command, limits=limits)
        return format_run(result, limits.timeout_s), result


def format_run(result: RunResult, timeout_s: float) -> str:
    """The model's view of a run: how it ended, which limits it hit, then stdout and stderr."""
    if result.timed_out:
        head = (
            f"Error: timed out after {timeout_s:g} s; the command and every process it started were killed."
        )
    elif result.killed_by == "output":
        head = f"Error: killed after writing {result.stdout_bytes + result.stderr_bytes} bytes of output (too much)."
    elif result.killed_by == "cpu":
        head = "Error: killed for using up its CPU-time limit."
    elif result.killed_by == "file_size":
        head = "Error: killed for writing a file larger than the file-size limit."
    elif result.signal is not None:
        head = f"Killed by signal {result.signal}."
    else:
        head = f"Exit code: {result.exit_code}"
    parts = [head]
    other = [limit for limit in result.limits_hit if limit not in ("timeout", result.killed_by, "output")]
    if other:
        parts.append(f"It ran into the sandbox's {', '.join(other).replace('_', ' ')} limit.")
    if result.stdout:
        parts.append(f"stdout:\n{result.stdout.rstrip()}")
    if result.stderr:
        parts.append(f"stderr:\n{result.stderr.rstrip()}")
    if not result.stdout and not result.stderr:
        parts.append("(no output)")
    return "\n".join(parts)


def _as_json(arguments: object) -> str:
    if arguments is None or isinstance(arguments, str):
        return arguments or ""
    try:
        return json.dumps(arguments)
    except (TypeError, ValueError):
        return str(arguments)  # not JSON: reported as invalid_json


_JSON_TYPES: dict[str, Callable[[object], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def validate_arguments(tool: Tool, args: Any) -> None:
    """Check a tool call's parsed ``args`` as ``Toolset`` does (for tools served elsewhere, e.g. an
    OpenEnv environment's); raises ``ToolError`` saying what is wrong."""
    _validate(tool, args)


def _validate(tool: Tool, args: Any) -> None:
    """Check ``args`` against the tool's schema; raise ``ToolError`` with what is wrong."""
    if not isinstance(args, dict):
        raise ToolError(
            "invalid_arguments",
            f"the arguments of {tool.name} must be a JSON object, not {type(args).__name__}",
        )
    if tool.external:
        _validate_external(tool, args)
        return
    properties: dict[str, dict[str, str]] = tool.parameters["properties"]
    # Models often send null for an optional argument they mean to leave out.
    for name in [n for n, v in args.items() if v is None and n not in tool.parameters["required"]]:
        del args[name]
    unknown = sorted(set(args) - set(properties))
    if unknown:
        expected = ", ".join(properties) or "none"
        raise ToolError(
            "invalid_arguments", f"{tool.name} has no argument {unknown[0]!r} (arguments: {expected})"
        )
    missing = [name for name in tool.parameters["required"] if name not in args]
    if missing:
        raise ToolError("invalid_arguments", f"{tool.name} needs the argument {missing[0]!r}")
    for name, value in args.items():
        kind = properties[name]["type"]
        fits = (
            isinstance(value, str)
            if kind == "string"
            else isinstance(value, int) and not isinstance(value, bool)
        )
        if not fits:
            article = "an" if kind == "integer" else "a"
            raise ToolError(
                "invalid_arguments",
                f"argument {name!r} of {tool.name} must be {article} {kind}, got {json.dumps(value)[:50]}",
            )


def _validate_external(tool: Tool, args: dict[str, Any]) -> None:
    """The top level of an external tool's JSON schema: required names, unknown names where the
    schema forbids them, and each given property's JSON type."""
    schema = tool.parameters
    properties: dict[str, Any] = schema.get("properties") or {}
    required: list[str] = schema.get("required") or []
    for name in [n for n, v in args.items() if v is None and n not in required]:
        if "null" not in _types(properties.get(name)):
            del args[name]
    if schema.get("additionalProperties") is False:
        unknown = sorted(set(args) - set(properties))
        if unknown:
            expected = ", ".join(properties) or "none"
            raise ToolError(
                "invalid_arguments", f"{tool.name} has no argument {unknown[0]!r} (arguments: {expected})"
            )
    missing = [name for name in required if name not in args]
    if missing:
        raise ToolError("invalid_arguments", f"{tool.name} needs the argument {missing[0]!r}")
    for name, value in args.items():
        kinds = [k for k in _types(properties.get(name)) if k in _JSON_TYPES]
        if kinds and not any(_JSON_TYPES[k](value) for k in kinds):
            raise ToolError(
                "invalid_arguments",
                f"argument {name!r} of {tool.name} must be of type {' or '.join(kinds)}, "
                f"got {json.dumps(value)[:50]}",
            )


def _types(schema: Any) -> list[str]:
    """The JSON types a property schema allows (``type``, or each ``anyOf`` branch's); [] is any."""
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list):
        kinds = [_types(b) for b in branches]
        return [] if any(not k for k in kinds) else [k for ks in kinds for k in ks]
    return []

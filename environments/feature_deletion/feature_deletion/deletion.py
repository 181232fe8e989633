"""Deleting a feature from a source file: a function, a method, or every method of a class.

A deletion keeps what specifies the feature and removes how it works: decorators, the signature
and the docstring stay; every line after the docstring (or after the signature when there is
none), comments included, is replaced by ``raise NotImplementedError``. Class attributes and the
class docstring of a deleted class stay; each of its methods is stubbed the same way.

``feature_size`` measures what a deletion removes (distinct syntax-tree nodes), so that trivial
features (a ``return 1``) are not tasks. ``candidates`` lists what can be deleted in a file (module-level functions, methods of
module-level and nested classes, classes with at least two methods); ``delete`` returns the new
file text and the removed blocks; ``distinctive_lines`` picks the removed lines that appear
nowhere else in the project, which is what the leak check looks for.
"""

from __future__ import annotations

import ast
import io
import textwrap
import tokenize
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

Kind = Literal["function", "method", "class"]

STUB = "raise NotImplementedError"


@dataclass(frozen=True)
class Body:
    """The lines of one function body that a deletion removes (1-based, inclusive)."""

    qualname: str
    first_line: int
    """Line of the ``def`` or of its first decorator: the function's ``co_firstlineno``."""
    start: int
    end: int
    indent: str
    has_docstring: bool

    @property
    def num_lines(self) -> int:
        return self.end - self.start + 1


@dataclass(frozen=True)
class Candidate:
    """Something a task can delete from ``file``."""

    kind: Kind
    file: str
    qualname: str
    bodies: tuple[Body, ...]
    """One body for a function or method, one per method for a class."""

    @property
    def num_lines(self) -> int:
        return sum(b.num_lines for b in self.bodies)

    @property
    def has_docstring(self) -> bool:
        return all(b.has_docstring for b in self.bodies)


def candidates(source: str, file: str) -> list[Candidate]:
    """Every function, method and class of ``source`` that could be deleted, in source order."""
    tree = ast.parse(source)
    lines = source.splitlines()
    found: list[Candidate] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            body = _body(node, node.name, lines)
            if body is not None:
                found.append(Candidate("function", file, node.name, (body,)))
        elif isinstance(node, ast.ClassDef):
            found.extend(_class_candidates(node, node.name, file, lines))
    return found


def _class_candidates(node: ast.ClassDef, qualname: str, file: str, lines: list[str]) -> Iterator[Candidate]:
    methods: list[Body] = []
    for child in node.body:
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            body = _body(child, f"{qualname}.{child.name}", lines)
            if body is not None:
                methods.append(body)
                yield Candidate("method", file, body.qualname, (body,))
        elif isinstance(child, ast.ClassDef):
            yield from _class_candidates(child, f"{qualname}.{child.name}", file, lines)
    if len(methods) >= 2:
        yield Candidate("class", file, qualname, tuple(methods))


def _body(node: ast.FunctionDef | ast.AsyncFunctionDef, qualname: str, lines: list[str]) -> Body | None:
    """The removable lines of a function, or ``None`` when it has nothing to remove or is written
    on one line with its signature."""
    statements = node.body
    has_docstring = (
        isinstance(statements[0], ast.Expr)
        and isinstance(statements[0].value, ast.Constant)
        and isinstance(statements[0].value.value, str)
    )
    code = statements[1:] if has_docstring else statements
    if not code:
        return None
    first_code = code[0]
    first_code_line = min([first_code.lineno, *(d.lineno for d in getattr(first_code, "decorator_list", []))])
    header_end = _header_end(node, lines)
    if first_code_line <= header_end or (has_docstring and statements[0].lineno <= header_end):
        return None  # ``def f(): return 1`` or a docstring on the def line
    start = (statements[0].end_lineno or 0) + 1 if has_docstring else header_end + 1
    end = code[-1].end_lineno or code[-1].lineno
    end = _trailing_comments(lines, end, _indent(lines[first_code.lineno - 1]))
    first_line = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    indent = _indent(lines[statements[0].lineno - 1])
    return Body(qualname, first_line, start, end, indent, has_docstring)


def _header_end(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> int:
    """Line of the colon that ends the signature: the first ``:`` outside brackets after ``def``."""
    text = "\n".join(lines[node.lineno - 1 :]) + "\n"
    depth = 0
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type != tokenize.OP:
            continue
        if token.string in "([{":
            depth += 1
        elif token.string in ")]}":
            depth -= 1
        elif token.string == ":" and depth == 0:
            return node.lineno + token.start[0] - 1
    raise AssertionError(f"no colon ends the signature of {node.name}")  # ast parsed it, so there is one


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _trailing_comments(lines: list[str], end: int, indent: str) -> int:
    """Extend ``end`` over comment lines indented like the body that directly follow it."""
    while end < len(lines):
        line = lines[end]
        if (
            line.strip().startswith("#")
            and _indent(line).startswith(indent)
            and len(_indent(line)) >= len(indent)
        ):
            end += 1
        else:
            break
    return end


def delete(source: str, candidate: Candidate) -> tuple[str, list[str]]:
    """``source`` with the candidate's bodies stubbed, and the removed text of each body."""
    lines = source.splitlines(keepends=True)
    removed: list[str] = []
    for body in sorted(candidate.bodies, key=lambda b: b.start, reverse=True):
        removed.append("".join(lines[body.start - 1 : body.end]))
        lines[body.start - 1 : body.end] = [f"{body.indent}{STUB}\n"]
    new_source = "".join(lines)
    ast.parse(new_source)  # a stub never breaks the syntax; an internal error if it does
    return new_source, removed[::-1]


def feature_size(source: str, candidate: Candidate) -> int:
    """How much a deletion removes, in syntax-tree nodes (contexts such as ``Load`` not counted),
    each distinct statement counted once: ``return 1`` is 2, ``x = a + b`` 6, and a class whose
    three methods each ``return 1`` is 2 as well. The filter that keeps trivial one-liners from
    becoming tasks."""
    lines = source.splitlines(keepends=True)
    seen: dict[str, int] = {}
    for body in candidate.bodies:
        code = textwrap.dedent("".join(lines[body.start - 1 : body.end]))
        for statement in ast.parse(code).body:
            key = ast.dump(statement)
            if key not in seen:
                seen[key] = sum(not isinstance(n, ast.expr_context) for n in ast.walk(statement))
    return sum(seen.values())


def normalize(line: str) -> str:
    return " ".join(line.split())


def distinctive_lines(removed: Iterable[str], other_texts: Iterable[str], min_chars: int = 12) -> list[str]:
    """Removed lines (whitespace-normalized, at least ``min_chars`` long) that occur in none of
    ``other_texts`` (the rest of the project: other files and what the deletion kept)."""
    elsewhere: set[str] = set()
    for text in other_texts:
        elsewhere.update(normalize(line) for line in text.splitlines())
    found: dict[str, None] = {}
    for block in removed:
        for line in block.splitlines():
            key = normalize(line)
            if len(key) >= min_chars and key not in elsewhere:
                found[key] = None
    return list(found)


def find_leaks(
    texts: dict[str, str], needles: Iterable[str], min_substring_chars: int = 24
) -> list[tuple[str, str]]:
    """``(file, needle)`` for every needle found in a file: equal to one of its lines (whitespace
    normalized), or, for needles of at least ``min_substring_chars``, anywhere in its text."""
    needles = list(needles)
    leaks = []
    for name, text in texts.items():
        lines = {normalize(line) for line in text.splitlines()}
        flat = normalize(text)
        for needle in needles:
            if needle in lines or (len(needle) >= min_substring_chars and needle in flat):
                leaks.append((name, needle))
    return leaks

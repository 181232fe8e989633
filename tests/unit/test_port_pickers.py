"""Tests pick free ports with the project's one helper, ``prime_composer.config.ports.free_port``.

A port picker of its own is a socket bound to port 0 whose number is used once the socket is
closed (``with socket.socket() as s: s.bind(("127.0.0.1", 0)); return s.getsockname()[1]``). The
scan reads every test file's syntax tree: a socket bound to port 0 must be a real listener in the
same function (``.listen()``, or handed to a server as ``sockets=[...]``, which binds before it
listens, with no race), and a helper named ``*free_port*`` must call ``free_port``.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

KNOWN: set[str] = set()
"""Files that still carry their own picker (each must still have one: drop it once converted)."""


def _bound_to_port_zero(node: ast.AST) -> str | None:
    """The name of the socket in ``<name>.bind((host, 0))``, else None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "bind"):
        return None
    if len(node.args) != 1 or not isinstance(node.args[0], ast.Tuple) or len(node.args[0].elts) != 2:
        return None
    port = node.args[0].elts[1]
    if not (isinstance(port, ast.Constant) and port.value == 0 and isinstance(node.func.value, ast.Name)):
        return None
    return node.func.value.id


def _is_sockets(key: ast.expr | None) -> bool:
    return isinstance(key, ast.Constant) and key.value == "sockets"


def _listens(scope: ast.AST, name: str) -> bool:
    for node in ast.walk(scope):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "listen"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == name
        ):
            return True
        handed = []  # what is given to a server as sockets=[...] (a keyword, or a kwargs dict)
        if isinstance(node, ast.keyword) and node.arg == "sockets":
            handed.append(node.value)
        if isinstance(node, ast.Dict):
            handed += [v for k, v in zip(node.keys, node.values, strict=True) if _is_sockets(k)]
        if any(isinstance(n, ast.Name) and n.id == name for value in handed for n in ast.walk(value)):
            return True
    return False


def pickers(source: str) -> list[str]:
    """``<function>:<line>`` of every port picker of its own in ``source``."""
    tree = ast.parse(source)
    found = []
    scopes: list[ast.AST] = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))]
    for scope in scopes:
        body = (
            scope.body
            if isinstance(scope, ast.FunctionDef)
            else [n for n in tree.body if not isinstance(n, ast.FunctionDef | ast.ClassDef)]
        )
        where = scope.name if isinstance(scope, ast.FunctionDef) else "<module>"
        for node in (n for stmt in body for n in ast.walk(stmt)):
            name = _bound_to_port_zero(node)
            if name is not None and not _listens(scope, name):
                found.append(f"{where}:{node.lineno}")  # type: ignore[attr-defined]
        if (
            isinstance(scope, ast.FunctionDef)
            and "free_port" in scope.name
            and not scope.name.startswith("test_")
        ):
            calls = {
                n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                for n in ast.walk(scope)
                if isinstance(n, ast.Call)
            }
            if "free_port" not in calls:
                found.append(f"{scope.name}:{scope.lineno}")
    return sorted(set(found))


def test_the_scan_finds_a_picker_and_passes_a_listener() -> None:
    picker = (
        "import socket\ndef _free_port():\n    with socket.socket() as s:\n"
        "        s.bind(('127.0.0.1', 0))\n        return s.getsockname()[1]\n"
    )
    assert pickers(picker) == ["_free_port:2", "_free_port:4"]  # its name, and its bind
    listener = (
        "def busy():\n    with socket.socket() as s:\n        s.bind(('127.0.0.1', 0))\n        s.listen()\n"
    )
    served = (
        "def serve():\n    sock = socket.socket()\n    sock.bind(('127.0.0.1', 0))\n    run(sockets=[sock])\n"
    )
    threaded = "def serve():\n    sock = socket.socket()\n    sock.bind(('', 0))\n    Thread(kwargs={'sockets': [sock]})\n"
    wrapper = "def free_port():\n    return ports.free_port('127.0.0.1', TAKEN)\n"
    in_a_string = "CODE = \"s = socket.socket(); s.bind(('127.0.0.1', 0))\"\n"
    assert (
        pickers(listener)
        == pickers(served)
        == pickers(threaded)
        == pickers(wrapper)
        == pickers(in_a_string)
        == []
    )


def test_no_test_file_has_its_own_port_picker() -> None:
    found = {}
    for path in sorted(TESTS.rglob("*.py")):
        hits = pickers(path.read_text())
        if hits:
            found[path.relative_to(TESTS).as_posix()] = hits
    unexpected = {f: h for f, h in found.items() if f not in KNOWN}
    assert not unexpected, (
        f"port pickers of their own (use prime_composer.config.ports.free_port): {unexpected}"
    )
    assert set(found) >= KNOWN, f"converted, drop from KNOWN: {sorted(KNOWN - set(found))}"

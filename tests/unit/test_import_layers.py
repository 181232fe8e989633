"""Dependencies point down: a lower layer never imports a package above it (``FORBIDDEN``) and no
two modules import each other, directly or around a loop. Read from the source (``ast``), so a
lazy import inside a function and a ``TYPE_CHECKING`` import count too. What a layer reaches above
itself it reaches by name through a ``registry.Registry`` (channels, backends, config dialects).
Before ``process_group.py``, ``inference/vllm/launch.py`` imported ``launch.process`` for
``die_with_parent``; ``config/channels.py`` imported ``orchestrator.channel`` for its types."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "prime_composer"

ABOVE_CONFIG = (
    "launch", "eval", "orchestrator", "trainer", "diloco", "inference", "teacher", "channels", "integrations",
)  # fmt: skip
FORBIDDEN = {
    "inference": (
        "launch",
        "eval",
        "orchestrator",
        "trainer",
        "diloco",
        "teacher",
        "channels",
        "prime_rl",
        "integrations",
    ),
    "diloco": (
        "launch",
        "eval",
        "orchestrator",
        "trainer",
        "inference",
        "teacher",
        "channels",
        "prime_rl",
        "integrations",
    ),
    "config": (*ABOVE_CONFIG, "prime_rl", "transport", "client", "sandbox", "wire"),
    "client": (*ABOVE_CONFIG, "prime_rl", "transport"),
    "transport": (*ABOVE_CONFIG, "prime_rl"),
    "wire": (*ABOVE_CONFIG, "prime_rl", "transport", "client"),
    "teacher": (
        "launch",
        "eval",
        "orchestrator",
        "trainer",
        "diloco",
        "channels",
        "prime_rl",
        "integrations",
    ),
    "prime_rl": (
        "launch",
        "eval",
        "orchestrator",
        "trainer",
        "diloco",
        "inference",
        "teacher",
        "channels",
        "integrations",
    ),
    "registry.py": ("*",),
    # The framework bridges sit above orchestrator and trainer; nothing below imports them.
    "orchestrator": ("integrations",),
    "trainer": ("integrations",),
    "channels": ("integrations",),
    "launch": ("integrations",),
}
"""Package (or top-level module) -> the packages of ``prime_composer`` it must not import (``*``:
none at all)."""


def imported_modules(path: Path, *, typing_only: bool = True, known: set[str] | None = None) -> set[str]:
    """The modules ``path`` imports; without ``typing_only``, not those under ``if TYPE_CHECKING:``.
    ``from package import name`` is the module ``package.name`` when that is one of ``known``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    if not typing_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
                node.body = []
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names}
            if node.module == "prime_composer" or (
                known is not None and submodules <= known
            ):  # from prime_composer import x
                names.update(submodules)
            else:
                names.add(node.module)
    return names


def violations(src: Path, package: str, forbidden: tuple[str, ...]) -> list[str]:
    root = src / package
    paths = [root] if root.is_file() else sorted(root.rglob("*.py"))
    bad = []
    for path in paths:
        for name in imported_modules(path):
            parts = name.split(".")
            if (
                parts[0] == "prime_composer"
                and len(parts) > 1
                and ("*" in forbidden or parts[1] in forbidden)
            ):
                bad.append(f"{path.relative_to(src)} imports {name}")
    return bad


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_back_up_a_layer(package: str) -> None:
    bad = violations(SRC, package, FORBIDDEN[package])
    assert not bad, "\n".join(bad)


def test_a_layer_violation_is_found(tmp_path: Path) -> None:
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "fine.py").write_text("from prime_composer.config.base import BaseConfig\n")
    (tmp_path / "config" / "bad.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from prime_composer.orchestrator.channel import OrchestratorChannel\n"
        "def f():\n    import prime_composer.launch.rl\n    from prime_composer import teacher\n"
    )
    found = violations(tmp_path, "config", FORBIDDEN["config"])
    assert sorted(found) == [
        "config/bad.py imports prime_composer.launch.rl",
        "config/bad.py imports prime_composer.orchestrator.channel",
        "config/bad.py imports prime_composer.teacher",
    ]


def module_graph(src: Path) -> dict[str, set[str]]:
    """Module -> the project modules it imports (a package import counts as its ``__init__``).
    An annotation-only import under ``TYPE_CHECKING`` counts too: it runs nothing, but two modules
    that name each other's types are one module split in two, and the loop would run the day the
    annotation is needed at runtime (a pydantic field, a ``get_type_hints``)."""
    modules = {
        ".".join(("prime_composer", *p.relative_to(src).with_suffix("").parts)).removesuffix(".__init__"): p
        for p in src.rglob("*.py")
    }
    known = set(modules)
    return {
        name: {m for m in imported_modules(path, known=known) if m in known and m != name}
        for name, path in modules.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path ``[a, b, ..., a]``, or None (iterative DFS)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
            elif state.get(child) == 1:
                path = [n for n, _ in stack]
                return [*path[path.index(child) :], child]
            elif not state.get(child):
                state[child] = 1
                stack.append((child, iter(sorted(graph[child]))))
    return None


def test_no_import_cycle() -> None:
    cycle = find_cycle(module_graph(SRC))
    assert cycle is None, " -> ".join(cycle or [])


def test_a_cycle_is_found() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_a_typing_only_cycle_is_found(tmp_path: Path) -> None:
    sources = {
        "a": "from prime_composer.pkg.b import B\n",
        "b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from prime_composer.pkg.a import A\n",
        "c": "from prime_composer.pkg import a\n",
    }
    (tmp_path / "pkg").mkdir()
    for name, text in sources.items():
        (tmp_path / "pkg" / f"{name}.py").write_text(text)
    cycle = ["prime_composer.pkg.a", "prime_composer.pkg.b", "prime_composer.pkg.a"]
    assert find_cycle(module_graph(tmp_path)) == cycle

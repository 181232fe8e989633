"""Dependencies point down: a serving or outer-loop module never imports the launcher (or other
processes' packages) above it. Read from the source (``ast``), so a lazy import inside a
function counts too. Before ``process_group.py``, ``inference/vllm/launch.py`` imported
``launch.process`` for ``die_with_parent``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "prime_composer"

FORBIDDEN = {
    "inference": ("launch", "eval", "orchestrator", "trainer", "diloco"),
    "diloco": ("launch", "eval", "orchestrator", "trainer", "inference"),
}
"""Package -> the packages of ``prime_composer`` it must not import."""


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_back_up_a_layer(package: str) -> None:
    bad = []
    for path in sorted((SRC / package).rglob("*.py")):
        for name in imported_modules(path):
            parts = name.split(".")
            if parts[0] == "prime_composer" and len(parts) > 1 and parts[1] in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(SRC)} imports {name}")
    assert not bad, "\n".join(bad)

"""Test files are imported by their basename (pytest's default ``prepend`` import mode, no
``__init__.py`` in most test folders), so two files with one name in two folders break
collection on a clean checkout ("import file mismatch"), even though each passes alone."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_file_basenames_are_unique_across_folders() -> None:
    folders: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        if not (path.parent / "__init__.py").exists():
            folders[path.name].append(str(path.parent.relative_to(TESTS)))
    clashes = {name: sorted(where) for name, where in folders.items() if len(where) > 1}
    assert not clashes, f"rename one file of each pair (same basename in two test folders): {clashes}"

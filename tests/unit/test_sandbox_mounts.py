"""The sandbox's mount plan: a hidden folder inside another hidden one is not mounted again."""

from __future__ import annotations

import sys
from pathlib import Path

from prime_composer.sandbox.mounts import plan


def test_a_hidden_folder_inside_a_hidden_folder_is_covered_by_the_outer_one(tmp_path: Path) -> None:
    outer = tmp_path / "sdk"
    inner = outer / "lib" / "vendored" / "__pycache__"
    inner.mkdir(parents=True)
    mounts = plan(
        system_paths=[tmp_path],
        python_env=Path(sys.prefix),
        exposed_paths=[],
        hidden_paths=[inner, outer],
        private_tmp_paths=[],
    )
    targets = [m[1] for m in mounts if m[0] == "hide"]
    # The outer folder is covered once; mounting over the inner one would fail inside (its mount
    # point is gone under the outer empty tmpfs).
    assert str(outer) in targets
    assert str(inner) not in targets

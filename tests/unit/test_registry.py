"""``registry.Registry``: entries registered by name, their modules imported on first use."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from prime_composer.registry import Registry

REG: Registry[int] = Registry("toy.kind", {"one": "toy_registry_one", "none": "toy_registry_none"})


def test_a_module_is_imported_only_when_its_name_is_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    here = __name__  # the toy module registers into this module's REG, as a backend module would
    (tmp_path / "toy_registry_one.py").write_text(
        f"import sys\nsys.modules[{here!r}].REG.register('one', 1)\n"
    )
    (tmp_path / "toy_registry_none.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "one" not in REG and "toy_registry_one" not in sys.modules
    assert REG.get_or_load("one") == 1 and set(REG) == {"one"} and "toy_registry_one" in sys.modules
    with pytest.raises(ValueError, match=r"toy\.kind 'one' is registered twice"):
        REG.register("one", 2)
    with pytest.raises(ValueError, match=r"toy\.kind = 'two': choose one of \['none', 'one'\]"):
        REG.get_or_load("two")
    with pytest.raises(ValueError, match="toy_registry_none registered nothing under that name"):
        REG.get_or_load("none")
    REG.unregister("one")
    assert len(REG) == 0

"""The shipped DiLoCo TOMLs (``infra/diloco/configs``) parse: their ``[diloco]`` tables (after
includes, per-DC file over the shared one) against ``DilocoConfig``, everything else against
``RLConfig``. Once ``[diloco]`` is a section of ``RLConfig`` these files move to ``configs/`` and
``test_shipped_configs.py`` resolves them whole."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from prime_composer.config.diloco import DilocoConfig
from prime_composer.config.resolve import resolve_rl_config

REPO = Path(__file__).resolve().parents[2]
DIR = REPO / "infra" / "diloco" / "configs"
SHARED = DIR / "diloco-quickstart.toml"
PER_DC = sorted(p for p in DIR.glob("diloco-*.toml") if p != SHARED)


def _load(path: Path) -> dict[str, Any]:
    """A TOML with its includes merged (includes resolve in ``configs/`` or beside the file)."""
    data = tomllib.loads(path.read_text())
    merged: dict[str, Any] = {}
    for name in data.pop("include", []):
        found = path.parent / name if (path.parent / name).exists() else REPO / "configs" / name
        _merge(merged, _load(found))
    _merge(merged, data)
    return merged


def _merge(into: dict[str, Any], other: dict[str, Any]) -> None:
    for key, value in other.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


@pytest.mark.parametrize("path", PER_DC, ids=[p.name for p in PER_DC])
def test_per_dc_file_over_the_shared_one_parses(path: Path, tmp_path: Path) -> None:
    import tomli_w

    merged = _load(SHARED)
    _merge(merged, _load(path))
    diloco = DilocoConfig.model_validate(merged.pop("diloco"))
    assert diloco.enabled and diloco.secret_env == "DILOCO_SECRET" and diloco.peers
    rest = tmp_path / "rest.toml"
    rest.write_text(tomli_w.dumps(merged))
    config, _ = resolve_rl_config(["@", str(rest)])
    assert config.max_steps >= 1


def test_the_two_quickstart_dcs_point_at_each_other() -> None:
    a, b = (
        DilocoConfig.model_validate(_load(SHARED)["diloco"] | _load(DIR / f"diloco-dc-{x}.toml")["diloco"])
        for x in "ab"
    )
    assert a.peers[0].urls == [f"http://127.0.0.1:{b.port}"] and b.peers[0].urls == [
        f"http://127.0.0.1:{a.port}"
    ]
    assert a.cluster_ids == b.cluster_ids

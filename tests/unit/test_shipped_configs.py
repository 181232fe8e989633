"""Every TOML shipped in configs/ resolves without error (a typo there would meet every new user)."""

from __future__ import annotations

from pathlib import Path

import pytest

from prime_composer.config.resolve import resolve_rl_config

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
CONFIGS = sorted(CONFIG_DIR.rglob("*.toml"))


def test_configs_folder_is_not_empty() -> None:
    assert any(p.name == "quickstart.toml" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(CONFIG_DIR)) for p in CONFIGS])
def test_shipped_config_resolves(path: Path) -> None:
    config, _ = resolve_rl_config(["@", str(path)])
    assert config.max_steps >= 1
    assert config.trainer.max_steps == config.orchestrator.max_steps == config.max_steps

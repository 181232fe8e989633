"""SDPO needs both halves on: orchestrator hints and a trainer weight; one alone is a config error."""

from __future__ import annotations

from pathlib import Path

import pytest

from prime_composer.config.errors import ConfigError
from prime_composer.config.resolve import resolve_rl_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_quickstart_sdpo_turns_both_halves_on():
    config, _ = resolve_rl_config(["@", str(CONFIGS / "quickstart-sdpo.toml")])
    assert config.orchestrator.sdpo.enabled and config.trainer.loss.sdpo.weight > 0


def test_hints_without_weight_is_an_error():
    with pytest.raises(ConfigError, match=r"trainer\.loss\.sdpo\.weight = 0"):
        resolve_rl_config(["@", str(CONFIGS / "quickstart-sdpo.toml"), "--trainer.loss.sdpo.weight", "0"])


def test_weight_without_hints_is_an_error():
    with pytest.raises(ConfigError, match=r"orchestrator\.sdpo\.enabled = false"):
        resolve_rl_config(["@", str(CONFIGS / "quickstart.toml"), "--trainer.loss.sdpo.weight", "0.1"])

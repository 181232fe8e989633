"""Every TOML shipped in configs/ resolves without error (a typo there would meet every new user)."""

from __future__ import annotations

from pathlib import Path

import pytest

from prime_composer.config.processes import SECTION_NAMES
from prime_composer.config.resolve import resolve_rl_config

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
# A folder with a file named after a process (configs/composer/trainer.toml) holds a split config,
# whose files only resolve together (--trainer @ ...): test_composer_config.py resolves those.
CONFIGS = sorted(
    p
    for p in CONFIG_DIR.rglob("*.toml")
    if not any((p.parent / f"{name}.toml").is_file() for name in SECTION_NAMES)
    and not p.name.startswith("ablation")  # an ablation's own config (uv run ablate @ ...)
)
ABLATIONS = sorted(CONFIG_DIR.glob("ablation*.toml"))


@pytest.mark.parametrize("path", ABLATIONS, ids=lambda p: p.name)
def test_shipped_ablation_config_loads(path: Path) -> None:
    from prime_composer.eval import ablate

    config = ablate.load_config(path)
    assert len(config.arms) >= 2


@pytest.mark.parametrize("path", ABLATIONS, ids=lambda p: p.name)
def test_shipped_ablation_arms_resolve_on_the_same_samples(path: Path, tmp_path: Path) -> None:
    """Every arm's generated rl config resolves (in process: what ``ablate --dry-run`` asks of
    ``rl --dry-run``) and trains on the same samples as the first arm."""
    from prime_composer.eval import ablate

    config = ablate.load_config(path, {"output_dir": str(tmp_path)})
    resolved = {}
    for arm in config.arms:
        generated = ablate.write_run_config(config, arm, config.seeds[0])
        rl, _ = resolve_rl_config(["@", str(generated)])
        assert rl.seed == config.seeds[0] and rl.output_dir == ablate.run_dir(
            config, arm.name, config.seeds[0]
        )
        resolved[arm.name] = rl.model_dump(mode="json")
    first = resolved[config.arms[0].name]
    for name, other in resolved.items():
        for key in ablate.SAME_SAMPLES_KEYS:
            assert ablate._dig(other, key) == ablate._dig(first, key), (name, key)


def test_configs_folder_is_not_empty() -> None:
    assert any(p.name == "quickstart.toml" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(CONFIG_DIR)) for p in CONFIGS])
def test_shipped_config_resolves(path: Path) -> None:
    config, _ = resolve_rl_config(["@", str(path)])
    assert config.max_steps >= 1
    assert config.trainer.max_steps == config.orchestrator.max_steps == config.max_steps

"""Sandbox config: paths that would vanish inside the sandbox and inconsistent limits are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from prime_composer.config.sandbox import LimitsConfig, SandboxConfig, ToolsConfig


def test_defaults_parse() -> None:
    config = SandboxConfig()
    assert config.limits.timeout_s < config.test_limits.timeout_s
    assert "run_tests" in ToolsConfig().enabled


@pytest.mark.parametrize("root", ["/tmp/ws", "/var/tmp/ws", "/dev/shm"])
def test_root_dir_under_a_private_tmp_is_refused(root: str) -> None:
    with pytest.raises(ValidationError, match="replaced inside the sandbox"):
        SandboxConfig(root_dir=Path(root))


def test_root_dir_elsewhere_is_accepted() -> None:
    # The workspace is bound at its own path wherever it lies (nothing else of the host is there).
    assert SandboxConfig(root_dir=Path("/root/ws")).root_dir == Path("/root/ws")


def test_relative_paths_are_refused() -> None:
    with pytest.raises(ValidationError, match="absolute"):
        SandboxConfig(root_dir=Path("ws"))
    with pytest.raises(ValidationError, match="absolute"):
        SandboxConfig(exposed_paths=[Path("venv")])
    with pytest.raises(ValidationError, match="system_paths"):
        SandboxConfig(system_paths=[Path("usr")])


def test_kill_threshold_below_the_kept_output_is_refused() -> None:
    with pytest.raises(ValidationError, match="kill_output_bytes"):
        LimitsConfig(max_output_bytes=10_000, kill_output_bytes=5_000)


def test_unknown_keys_and_tools_are_refused() -> None:
    with pytest.raises(ValidationError):
        SandboxConfig.model_validate({"limits": {"timeout": 3}})
    with pytest.raises(ValidationError):
        ToolsConfig(enabled=["run", "rm_rf"])  # type: ignore[list-item]
    with pytest.raises(ValidationError, match="twice"):
        ToolsConfig(enabled=["run", "run"])

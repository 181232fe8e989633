"""``rl export`` never clobbers and never copies damage: an existing target is refused unless
``--force`` (a user's file in it survives), ``--force`` leaves no stale file of the old model (a
sharded index next to the new weights), a model directory with a flipped byte is refused naming the
file, and a target under a regular file, on a read-only mount or on a full disk is a one-line error
that leaves the target as it was; `eval` of a damaged model directory is refused the same way."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from prime_composer.config.base import ModelConfig
from prime_composer.trainer.export import main
from prime_composer.trainer.model import load_model
from prime_composer.transport.weights import publish_weights


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A run directory with published weights of step 3, and its config file."""
    root = tmp_path_factory.mktemp("run")
    output_dir = root / "out"
    torch.manual_seed(0)
    model, _ = load_model(ModelConfig(name="builtin:tiny-qwen3", dtype="float32"), torch.device("cpu"))
    publish_weights(model, model.config, output_dir / "broadcasts", 3)
    config = root / "rl.toml"
    config.write_text(
        f'max_steps = 3\noutput_dir = "{output_dir}"\n[model]\nname = "builtin:tiny-qwen3"\n'
        '[[orchestrator.env]]\nid = "arith"\n'
    )
    return config, output_dir


def _export(run: tuple[Path, Path], target: Path, *extra: str, source: Path | None = None) -> int:
    config, output_dir = run
    checkpoint = source or output_dir / "broadcasts" / "step_3"
    return main(["@", str(config), "--checkpoint", str(checkpoint), "--export-dir", str(target), *extra])


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "Traceback" not in captured.err + captured.out
    assert len(err.splitlines()) == 1, err
    return err


def test_an_existing_target_is_refused_without_force(run, tmp_path: Path, capsys) -> None:
    target = tmp_path / "export"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    assert _export(run, target) == 2, "an existing export_dir was replaced: the fault was accepted"
    err = _one_line_error(capsys)
    assert str(target) in err and "--force" in err
    assert (target / "notes.txt").read_text() == "mine"


def test_force_replaces_the_target_without_stale_files(run, tmp_path: Path) -> None:
    target = tmp_path / "export"
    target.mkdir()
    (target / "model.safetensors.index.json").write_text('{"weight_map": {}}')  # an old sharded model
    (target / "model-00001-of-00002.safetensors").write_bytes(b"old")
    assert _export(run, target, "--force") == 0
    names = {p.name for p in target.iterdir()}
    assert "model.safetensors" in names and "config.json" in names
    stale = names & {"model.safetensors.index.json", "model-00001-of-00002.safetensors"}
    assert not stale, f"stale files {stale} kept next to the new weights: accepted"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]  # no staging left


def test_a_damaged_model_directory_is_not_exported(run, tmp_path: Path, capsys) -> None:
    good = tmp_path / "good"
    assert _export(run, good) == 0
    damaged = tmp_path / "damaged"
    shutil.copytree(good, damaged)
    weights = damaged / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x10
    weights.write_bytes(bytes(data))
    target = tmp_path / "export"
    assert _export(run, target, source=damaged) == 2, "a flipped byte was exported: accepted"
    assert "model.safetensors" in _one_line_error(capsys)
    assert not target.exists()


def test_a_target_under_a_regular_file_is_a_one_line_error(run, tmp_path: Path, capsys) -> None:
    (tmp_path / "file").write_text("x")
    assert _export(run, tmp_path / "file" / "export") == 2
    assert "cannot write" in _one_line_error(capsys)


def _mount(where: Path, options: str) -> None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs")
    where.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)]).returncode != 0:
        pytest.skip("mount -t tmpfs failed (no CAP_SYS_ADMIN in this container)")


@pytest.mark.parametrize("case", ["read-only", "full"])
def test_a_read_only_or_full_filesystem_is_a_one_line_error(run, tmp_path: Path, capsys, case: str) -> None:
    disk = tmp_path / "disk"
    _mount(disk, "size=1m,ro" if case == "read-only" else "size=256k")
    try:
        assert _export(run, disk / "export") == 2
        err = _one_line_error(capsys)
        assert "cannot write" in err and ("Read-only" in err or "No space" in err), err
        assert not (disk / "export").exists()
        assert not list(disk.iterdir()), "the failed export left files behind"
    finally:
        subprocess.run(["umount", str(disk)])


def test_eval_refuses_a_damaged_model_directory(run, tmp_path: Path) -> None:
    """``eval --checkpoint`` on a model directory with a flipped byte stops with one line naming the
    file, before any server is started (it served the damaged weights before)."""
    from prime_composer.config.errors import ConfigError
    from prime_composer.config.evaluate import EvalRunConfig
    from prime_composer.eval.main import model_directory

    good = tmp_path / "good"
    assert _export(run, good) == 0
    weights = good / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x10
    weights.write_bytes(bytes(data))
    output_dir = run[1]
    eval_config = EvalRunConfig.model_validate(
        {
            "model": {"name": "builtin:tiny-qwen3"},
            "output_dir": str(output_dir),
            "checkpoint": str(good),
            "orchestrator": {"env": [{"id": "arith"}]},
        }
    )
    with pytest.raises(ConfigError, match=r"model\.safetensors"):
        model_directory(eval_config, tmp_path / "results")

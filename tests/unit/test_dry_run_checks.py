"""``--dry-run`` runs every check that needs no process, and each mistake is one line: a bind
without a secret, an unset secret variable, missing model and data paths, a context too short for
the rollouts, W&B online without a reachable server (before the run directory is touched), numbers
out of range and quoted numbers; the standalone ``inference`` refuses a bad bind at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prime_composer.config.errors import ConfigError
from prime_composer.config.ports import free_port
from prime_composer.config.resolve import resolve_rl_config
from prime_composer.launch import rl
from prime_composer.launch.preflight import _length_problems

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
QUICKSTART = str(CONFIGS / "quickstart.toml")


def dry_run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        rl.main(["@", QUICKSTART, *argv, "--dry-run"])
    return int(exit_info.value.code or 0), capsys.readouterr().err


def test_the_quickstart_passes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, err = dry_run(capsys, "--output-dir", str(tmp_path / "run"))
    assert code == 0, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--inference.host", "0.0.0.0"], "inference.host = '0.0.0.0' is reachable from other machines"),
        (["--inference.secret-env", "DRY_RUN_UNSET_SECRET"], "inference.secret_env = 'DRY_RUN_UNSET_SECRET'"),
        (
            ["--model.name", "/nonexistent/model-dir"],
            "model.name = '/nonexistent/model-dir': no such directory",
        ),
        (["--warmup.data", "/nonexistent/sft.jsonl"], "warmup.data = '/nonexistent/sft.jsonl': no such file"),
        (
            ["--inference.max-model-len", "8", "--orchestrator.seq-len", "512"],
            "inference.max_model_len = 8 leaves no room for a prompt",
        ),
        (
            ["--inference.max-model-len", "256", "--orchestrator.seq-len", "512"],
            "inference.max_model_len = 256 is shorter than orchestrator.seq_len = 512",
        ),
    ],
    ids=[
        "bind-without-secret",
        "unset-secret",
        "missing-model",
        "missing-warmup-data",
        "context-8",
        "context-256",
    ],
)
def test_dry_run_names_the_problem(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], message: str
) -> None:
    code, err = dry_run(capsys, "--output-dir", str(tmp_path / "run"), *argv)
    assert code == 2 and message in err, err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_wandb_online_without_a_server_fails_before_the_run_dir(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "previous.log").write_text("a previous run's log\n")
    argv = ["@", QUICKSTART, "--output-dir", str(run_dir), "--wandb.mode", "online", "--launch.overwrite"]
    started = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        rl.main(argv)  # the launch itself, not only --dry-run
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert 'wandb.mode = "online" but 127.0.0.1:' in err and "cannot be reached" in err, err
    assert len([line for line in err.splitlines() if "wandb" in line]) == 1 and "Traceback" not in err
    assert (run_dir / "logs" / "previous.log").read_text() == "a previous run's log\n"  # untouched
    assert time.monotonic() - started < 30
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    code, err = dry_run(capsys, "--output-dir", str(run_dir), "--wandb.mode", "online")
    assert code == 2 and "no W&B API key" in err, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-steps", "1" * 29], "max_steps"),
        (["--trainer.optim.lr", "1e9"], "trainer.optim.lr"),
        (["--trainer.model.lora", "{rank = 8, alpha = 1e30}"], "trainer.model.lora.alpha"),
        (["--warmup.lr", "5.0"], "warmup.lr"),
    ],
    ids=["max-steps-29-digits", "lr-1e9", "lora-alpha-1e30", "warmup-lr-5"],
)
def test_numbers_out_of_range_are_refused(tmp_path: Path, argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        resolve_rl_config(["@", QUICKSTART, "--output-dir", str(tmp_path), *argv])
    assert "less than or equal to" in str(info.value)


def test_quoted_numbers_are_refused_and_toml_ints_still_fill_floats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    quoted = tmp_path / "quoted.toml"
    quoted.write_text("seed = '5'\n")
    with pytest.raises(ConfigError, match=r"seed = '5': text \('5'\) where an integer is expected"):
        resolve_rl_config(["@", QUICKSTART, "@", str(quoted)])
    quoted.write_text("[trainer.optim]\nlr = '1e-4'\n")
    with pytest.raises(ConfigError, match="where a number is expected"):
        resolve_rl_config(["@", QUICKSTART, "@", str(quoted)])
    plain = tmp_path / "plain.toml"
    plain.write_text("seed = 5\n[trainer.optim]\nlr = 1\n")
    config, _ = resolve_rl_config(["@", QUICKSTART, "@", str(plain)])
    assert config.seed == 5 and config.trainer.optim.lr == 1.0
    # Environment variables and flags are text by nature: they are read as TOML values.
    monkeypatch.setenv("PRIME_COMPOSER_SEED", "7")
    monkeypatch.setenv("PRIME_COMPOSER_TRAINER__OPTIM__LR", "3e-4")
    monkeypatch.setenv("PRIME_COMPOSER_ORCHESTRATOR__SAMPLING__EXTRA_BODY", '{"tag": "5"}')
    config, _ = resolve_rl_config(["--max-steps", "3"])
    assert (config.seed, config.trainer.optim.lr, config.max_steps) == (7, 3e-4, 3)
    assert config.orchestrator.sampling.extra_body == {"tag": "5"}  # free-form tables keep their text


@pytest.mark.parametrize(
    "path",
    sorted(p for p in CONFIGS.glob("*.toml") if not p.name.startswith("ablation")),
    ids=lambda p: p.name,
)
def test_shipped_configs_pass_the_length_check(path: Path) -> None:
    config, _ = resolve_rl_config(["@", str(path)])
    assert _length_problems(config) == []


@pytest.mark.parametrize("dry", [False, True], ids=["start", "dry-run"])
def test_standalone_inference_refuses_a_bind_without_secret_at_once(tmp_path: Path, dry: bool) -> None:
    command = [sys.executable, "-m", "prime_composer.inference.main", "--host", "0.0.0.0"]
    started = time.monotonic()
    proc = subprocess.run(
        command + (["--dry-run"] if dry else []),
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "inference.host = '0.0.0.0'" in proc.stderr
    assert "torch" not in proc.stderr and elapsed < 15, (elapsed, proc.stderr)

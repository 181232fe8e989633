"""The recipe config (``configs/composer.toml``): it resolves on a CPU machine (``--dry-run``), its
split files give the same config, it is the run the design describes (vLLM, FSDP2, DAPO-style
RL, SDPO and the replay channel on), and ``launch.gpus`` pins every process to its own GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prime_composer.config.errors import ConfigError
from prime_composer.config.resolve import resolve_rl_config
from prime_composer.launch.rl import build_specs

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "composer.toml"
SPLIT = ROOT / "configs" / "composer"
SPLIT_ARGV = ["@", str(SPLIT / "run.toml")] + [
    arg for name in ("inference", "orchestrator", "trainer", "teacher") for arg in (f"--{name}", "@", str(SPLIT / f"{name}.toml"))
]  # fmt: skip


def test_dry_run_prints_the_recipe_on_a_cpu_machine() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "prime_composer.launch.rl", "@", str(RECIPE), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
        # --dry-run checks that the variables the recipe names are set (their values stay unread).
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OPENAI_API_KEY": "sk-dry-run"},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)
    assert printed["inference"]["backend"] == "vllm" and printed["trainer"]["num_ranks"] == 6


def test_split_files_are_the_same_config() -> None:
    whole, _ = resolve_rl_config(["@", str(RECIPE)])
    split, _ = resolve_rl_config(SPLIT_ARGV)
    assert split.model_dump(mode="json") == whole.model_dump(mode="json")


def test_the_recipe_is_the_designed_run() -> None:
    config, _ = resolve_rl_config(["@", str(RECIPE)])
    assert config.model.name.startswith("Qwen/Qwen3-")
    assert {config.inference.model.name, config.trainer.model.name, config.orchestrator.model.name} == {
        config.model.name
    }
    assert config.inference.backend == "vllm"
    # FSDP2 on every trainer GPU, and no GPU shared between processes (8 in all).
    gpus = config.launch.gpus
    assert config.trainer.num_ranks == len(gpus["trainer"]) > 1 and config.trainer.mixed_precision
    assert len(gpus["inference"]) >= config.inference.vllm.tensor_parallel_size
    assert sorted(i for ids in gpus.values() for i in ids) == list(range(8))
    # DAPO: clip-higher, token-level averaging, dynamic sampling, soft overlong punishment, no KL.
    rl = config.trainer.loss.rl
    assert rl.eps_high > rl.eps_low and rl.aggregation == "token_mean" and rl.kl_coef == 0
    advantage = config.orchestrator.advantage
    assert advantage.dynamic_sampling and advantage.overlong_buffer > 0
    # SDPO and the replay channel, both halves of each, and the teacher service they need.
    assert config.orchestrator.sdpo.enabled and config.trainer.loss.sdpo.weight > 0
    assert config.orchestrator.replay.enabled and config.trainer.loss.replay.weight > 0
    assert config.teacher is not None and config.orchestrator.replay.teacher_url == "http://127.0.0.1:8100"
    assert all(e.api_key_env for e in config.teacher.pool)  # keys come from the environment only
    assert config.wandb is not None
    assert config.orchestrator.seq_len <= (config.inference.max_model_len or 0)


def test_each_process_sees_only_its_gpus(tmp_path: Path) -> None:
    config, _ = resolve_rl_config(["@", str(RECIPE)])
    specs = {s.name: s for s in build_specs(config, {n: tmp_path / f"{n}.json" for n in ("inference", "teacher", "orchestrator", "trainer")})}  # fmt: skip
    assert specs["inference"].env == {"CUDA_VISIBLE_DEVICES": "0"}
    assert specs["teacher"].env == {"CUDA_VISIBLE_DEVICES": "1"}
    assert specs["trainer"].env == {"CUDA_VISIBLE_DEVICES": "2,3,4,5,6,7"}
    assert "--nproc-per-node=6" in specs["trainer"].argv
    assert specs["orchestrator"].env == {}  # no GPU listed: it sees them all (and uses none)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--launch.gpus", "{inference = [0], trainer = [0]}"], "GPU 0 is given to both inference and trainer"),
        (["--launch.gpus", "{trainr = [0]}"], "launch.gpus.trainr: not a process"),
        (["--launch.gpus", "{trainer = []}"], "list GPU indices"),
        (["--launch.gpus", "{trainer = [0, 1]}", "--trainer.num-ranks", "3"], "trainer.num_ranks = 3"),
        (
            ["--inference.backend", "vllm", "--inference.vllm.tensor-parallel-size", "2", "--launch.gpus", "{inference = [0]}"],
            "tensor_parallel_size = 2",
        ),
    ],
)  # fmt: skip
def test_bad_gpu_assignments_are_errors(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_rl_config(["@", str(ROOT / "configs" / "quickstart.toml"), *flags])

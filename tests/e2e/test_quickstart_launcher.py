"""A few steps of the quickstart through the real launcher: inference, orchestrator and trainer
as separate processes, with the SFT warm-up, checkpoints, metrics and the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from prime_composer.checkpoint_layout import DEFAULT_PARTS, complete_steps

from .conftest import metric_steps, run_rl

pytestmark = pytest.mark.slow  # more than ~30 s on 2 cores: left out of the fast lane


def test_quickstart_runs_end_to_end(tmp_path: Path, quickstart_warmup: Path) -> None:
    out = tmp_path / "run"
    proc = run_rl(out, "--max-steps", "3", "--ckpt.interval", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr

    # The warm-up stage gives the same bits in every launch of the same config: here and in the
    # session's shared warm-up (the same settings, trained in another process), which the tests
    # that start from a warmed-up model use, and which the DCs of a DiLoCo run rely on (each runs
    # its own; tests/unit/test_diloco_configs.py checks they get the same data and settings).
    for name in ("data.jsonl", "final/model.safetensors"):
        assert (out / "sft" / name).read_bytes() == (quickstart_warmup.parent / name).read_bytes(), name

    # Every process wrote its resolved config, its log and (trainer, orchestrator) its metrics.
    for name in ("rl", "inference", "orchestrator", "trainer", "sft"):
        assert (out / "configs" / f"{name}.json").is_file()
    trainer_cfg = json.loads((out / "configs" / "trainer.json").read_text())
    assert trainer_cfg["model"]["name"] == str(out / "sft" / "final")  # RL starts from the warm-up
    for name in ("inference", "orchestrator", "trainer", "sft"):
        assert (out / "logs" / f"{name}.log").stat().st_size > 0
    assert metric_steps(out, "trainer") == [0, 1, 2]
    orchestrator = [
        json.loads(line) for line in (out / "metrics" / "orchestrator.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in orchestrator if "reward/mean" in r] == [0, 1, 2]
    assert any("eval/accuracy" in r for r in orchestrator)
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in orchestrator if "reward/mean" in r)

    # Weights were published after every step, checkpoints at 2 and at the end.
    assert (out / "broadcasts" / "step_3" / "STABLE").is_file()
    assert complete_steps(out / "checkpoints", DEFAULT_PARTS) == [2, 3]
    assert (out / "report.png").stat().st_size > 1000
    assert "reward: first" in proc.stdout

    # The exported model is the last published policy, loadable offline, with its model card.
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(out / "final", local_files_only=True)
    published = load_file(out / "broadcasts" / "step_3" / "model.safetensors")
    for name, tensor in final.state_dict().items():
        if name in published:
            assert torch.equal(tensor.float(), published[name].float()), name
    card = (out / "final" / "README.md").read_text()
    assert "builtin:tiny-qwen3" in card and "SFT warm-up" in card and "| end |" in card

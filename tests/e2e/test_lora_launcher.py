"""A LoRA run through the real launcher: the quickstart with ``[trainer.model.lora]``, no warm-up,
two steps, then a resume for a third. Every published step is an adapter (a few percent of the
model's bytes) that the embedded server loads, the checkpoints hold the adapter, and the final
export is the merged model, loadable as a plain Hugging Face model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from prime_composer.checkpoint_layout import complete_steps
from prime_composer.model.resolve import resolve_model_name

from .conftest import metric_steps, run_rl

pytestmark = pytest.mark.slow  # more than ~30 s on 2 cores: left out of the fast lane

LORA = ("--no-warmup.enabled", "--trainer.model.lora.rank", "4", "--trainer.model.lora.alpha", "8")


def test_lora_run_publishes_adapters_resumes_and_exports_merged(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_rl(out, "--max-steps", "2", *LORA)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert metric_steps(out, "trainer") == [0, 1]
    trainer_cfg = json.loads((out / "configs" / "trainer.json").read_text())
    assert trainer_cfg["model"]["lora"]["rank"] == 4

    base_bytes = (Path(resolve_model_name("builtin:tiny-qwen3")) / "model.safetensors").stat().st_size
    for step in (1, 2):
        published = out / "broadcasts" / f"step_{step}"
        assert (published / "STABLE").is_file() and not (published / "model.safetensors").exists()
        assert (published / "adapter_model.safetensors").stat().st_size < base_bytes / 10
    # The orchestrator's policy followed the adapters the server loaded.
    inference_log = (out / "logs" / "inference.log").read_text()
    assert "serving weights from" in inference_log and "step_2" in inference_log

    # Resume for one more step: the checkpoint of step 2 holds the adapter (and no base weights).
    assert complete_steps(out / "checkpoints", ("trainer", "orchestrator")) == [2]
    proc = run_rl(out, "--max-steps", "3", "--resume", *LORA)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert metric_steps(out, "trainer")[-1] == 2
    assert (out / "broadcasts" / "step_3" / "adapter_model.safetensors").is_file()

    from transformers import AutoModelForCausalLM

    from prime_composer.transport.adapter import load_adapter, merged_weights

    final = AutoModelForCausalLM.from_pretrained(out / "final", local_files_only=True)
    base = AutoModelForCausalLM.from_pretrained(resolve_model_name("builtin:tiny-qwen3"), dtype=torch.float32)
    expected = merged_weights(base.state_dict(), load_adapter(out / "broadcasts" / "step_3"))
    for key, tensor in expected.items():
        torch.testing.assert_close(final.state_dict()[key].float(), tensor, rtol=1e-5, atol=1e-6)

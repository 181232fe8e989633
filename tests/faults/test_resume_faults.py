"""Resume, export and eval against a changed config: a checkpoint of a 2-layer model resumed,
exported or evaluated with a 1-layer (or wider) ``model.name`` is a one-line error naming both
models (it used to be taken silently, the trained layers dropped, or to fail with a traceback); a
changed learning rate on resume is applied from the resumed step and logged as changed (it used to
be ignored while ``configs/trainer.json`` said otherwise); ``--resume`` with another model than the
warm-up started from is refused before anything in the run directory changes."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
import torch

from prime_composer.config.base import CheckpointConfig, ModelConfig
from prime_composer.config.errors import ConfigError
from prime_composer.config.optim import OptimConfig
from prime_composer.config.trainer import TrainerConfig
from prime_composer.orchestrator.packing import pack_step
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.state import OrchestratorState
from prime_composer.trainer.export import main as export_main
from prime_composer.trainer.export import to_hf_directory
from prime_composer.trainer.model import World
from prime_composer.trainer.train import Trainer

WORLD = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
TINY = "builtin:tiny-qwen3"
SMALLER = "builtin:tiny-qwen3?num_hidden_layers=1"
WIDER = "builtin:tiny-qwen3?hidden_size=256"


def _trainer(
    output_dir: Path, name: str = TINY, optim: OptimConfig | None = None, resume: bool = False
) -> Trainer:
    config = TrainerConfig(
        model=ModelConfig(name=name, dtype="float32"),
        output_dir=output_dir,
        max_steps=6,
        optim=optim or OptimConfig(lr=0.05),
        ckpt=CheckpointConfig(resume=resume),
    )
    return Trainer(config, WORLD)


def _micro_batches() -> list:
    rng = random.Random(0)
    samples = []
    for i in range(4):
        completion = [rng.randint(3, 400) for _ in range(5)]
        samples.append(
            Sample(
                prompt_ids=[rng.randint(3, 400) for _ in range(6)],
                completion_ids=completion,
                completion_logprobs=[-1.0] * len(completion),
                completion_mask=[1] * len(completion),
                reward=float(i % 2),
                example_id=i,
                group_id=0,
                policy_step=0,
                advantage=1.0 if i % 2 else -1.0,
            )
        )
    (mbs,), _ = pack_step(samples, 32, 2, 1, pad_token_id=0)
    return mbs


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory with a complete checkpoint of step 2 of the 2-layer tiny model (lr 0.05)."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("run")
    trainer = _trainer(out)
    for _ in range(2):
        trainer.step(_micro_batches())
    trainer.save_checkpoint(2)
    OrchestratorState(step=2).save(out / "checkpoints", keep=2)
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.parametrize("name", [SMALLER, WIDER], ids=["fewer-layers", "wider"])
def test_resume_with_another_architecture_is_refused_naming_both(
    run: Path, tmp_path: Path, name: str
) -> None:
    out = _copy(run, tmp_path)
    trainer = _trainer(out, name=name, resume=True)
    try:
        trainer.resume()
    except ValueError as e:
        message = str(e)
    else:
        pytest.fail("a checkpoint of another architecture was resumed from: the fault was accepted")
    assert "\n" not in message and repr(TINY) in message and repr(name) in message, message
    # Below the name check, the tensors themselves are compared (a checkpoint that records no
    # model, a directory renamed): DCP alone would load the smaller model silently.
    try:
        trainer.ckpt.load(2, trainer.model, trainer.optimizer, trainer.scheduler, model_name=name)
    except ValueError as e:
        message = str(e)
    else:
        pytest.fail("DCP loaded a checkpoint of another architecture: the fault was accepted")
    assert "\n" not in message and repr(TINY) in message and repr(name) in message, message
    detail = (
        "2 layers in the checkpoint, 1 in the model" if name == SMALLER else ", 128] in the checkpoint, ["
    )
    assert detail in message, message


def test_a_changed_lr_on_resume_is_applied_and_logged(run: Path, tmp_path: Path, caplog) -> None:
    out = _copy(run, tmp_path)
    new = OptimConfig(lr=0.0007, warmup_steps=4)  # step 2 of a 4-step warm-up: lr * 3/4
    trainer = _trainer(out, optim=new, resume=True)
    with caplog.at_level(logging.WARNING):
        trainer.resume()
    assert "trainer.optim.lr changed on resume at step 2: 0.05 -> 0.0007" in caplog.text
    expected = 0.0007 * 3 / 4
    lrs = [group["lr"] for group in trainer.optimizer.param_groups]
    assert lrs == pytest.approx([expected] * len(lrs), rel=1e-12), (
        f"lr {lrs}: the changed lr was not applied, accepted"
    )
    metrics = trainer.step(_micro_batches(), 2)
    assert metrics["lr"] == pytest.approx(expected, rel=1e-12)
    trainer.step(_micro_batches(), 3)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.0007, rel=1e-12)  # warm-up over


@pytest.mark.parametrize("name", [SMALLER, WIDER], ids=["fewer-layers", "wider"])
def test_export_of_a_checkpoint_into_another_architecture_is_one_line(
    run: Path, tmp_path: Path, capsys, name: str
) -> None:
    config = tmp_path / "rl.toml"
    config.write_text(
        f'max_steps = 6\noutput_dir = "{run}"\n[model]\nname = "{name}"\n[[orchestrator.env]]\nid = "arith"\n'
    )
    target = tmp_path / "export"
    code = export_main(["@", str(config), "--export-dir", str(target)])
    captured = capsys.readouterr()
    assert code == 2, "exported into another architecture: the fault was accepted"
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in captured.err, err
    assert repr(TINY) in err and repr(name) in err
    assert not target.exists()


def test_eval_of_a_model_directory_of_another_architecture_is_refused(run: Path, tmp_path: Path) -> None:
    from prime_composer.config.evaluate import EvalRunConfig
    from prime_composer.eval.main import model_directory

    model_dir = to_hf_directory(run / "checkpoints" / "step_2", ModelConfig(name=TINY), tmp_path / "model")
    config = EvalRunConfig.model_validate(
        {
            "model": {"name": SMALLER},
            "output_dir": str(run),
            "checkpoint": str(model_dir),
            "orchestrator": {"env": [{"id": "arith"}]},
        }
    )
    with pytest.raises(ConfigError, match=r"num_hidden_layers 2 in the checkpoint, 1 in the model"):
        model_directory(config, tmp_path / "results")


def test_resume_through_rl_with_another_model_than_the_warm_up_is_refused(run: Path, tmp_path: Path) -> None:
    """With the warm-up on, ``rl --resume`` hands the processes ``sft/final`` whatever model.name
    says: the launcher checks the warm-up's recorded base model first, before trimming anything."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "e2e_helpers", Path(__file__).resolve().parents[1] / "e2e" / "conftest.py"
    )
    assert spec is not None and spec.loader is not None
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    out = _copy(run, tmp_path)
    (out / "configs").mkdir(exist_ok=True)
    (out / "configs" / "sft.json").write_text(json.dumps({"model": {"name": TINY}}))
    (out / "rollouts" / "step_3").mkdir(parents=True)
    proc = helpers.run_rl(out, "--resume", "--model.name", SMALLER, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, f"resumed with another model: accepted. {text[-2000:]}"
    assert f"model.name = {SMALLER!r} (the run: {TINY!r})" in text and "Traceback" not in text, text[-2000:]
    assert (out / "rollouts" / "step_3").is_dir()  # nothing trimmed

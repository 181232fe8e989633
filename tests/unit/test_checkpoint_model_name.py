"""A checkpoint resumed with a same-shaped model of another name is refused, in one line naming
both models: the checkpoint manager records the model it saved and checks it on load (tensor
shapes alone cannot tell two models of one architecture apart). Covers the standalone ``sft``
trainer, which recorded nothing, and checkpoints that record the model in ``extra`` only (the RL
trainer's, before the manager recorded it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from prime_composer.config.base import CheckpointConfig, ModelConfig
from prime_composer.config.optim import OptimConfig
from prime_composer.config.sft import SFTConfig
from prime_composer.trainer.checkpoint import META_FILE, CheckpointManager
from prime_composer.trainer.model import World, load_model
from prime_composer.trainer.sft import run_sft, sft_dir

sys.path.insert(0, str(Path(__file__).parent))
from test_sft import _arithmetic_chats

WORLD = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
TINY = "builtin:tiny-qwen3"


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A local directory holding the same architecture as ``TINY`` under another name."""
    path = tmp_path_factory.mktemp("twin")
    model, tokenizer = load_model(ModelConfig(name=TINY, dtype="float32"), torch.device("cpu"))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _parts(name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    model, _ = load_model(ModelConfig(name=name, dtype="float32"), torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def test_the_manager_refuses_another_model_name_naming_both(tmp_path: Path, twin: str) -> None:
    manager = CheckpointManager(tmp_path, keep=2, world=WORLD)
    manager.save(1, *_parts(TINY), model_name=TINY)
    assert json.loads((tmp_path / "step_1" / "trainer" / META_FILE).read_text())["model"] == TINY
    with pytest.raises(ValueError) as info:
        manager.load(1, *_parts(twin), model_name=twin)
    message = str(info.value)
    assert "\n" not in message and repr(TINY) in message and repr(twin) in message, message
    manager.load(1, *_parts(TINY), model_name=TINY)  # the same model resumes


def test_a_name_recorded_in_extra_only_is_checked_too(tmp_path: Path, twin: str) -> None:
    manager = CheckpointManager(tmp_path, keep=2, world=WORLD)
    manager.save(1, *_parts(TINY), extra={"model": {"name": TINY}})  # as the RL trainer records it
    with pytest.raises(ValueError, match=f"model.name = {TINY!r}.*{twin!r}"):
        manager.load(1, *_parts(twin), model_name=twin)


def test_sft_resumed_with_a_same_shaped_model_of_another_name_is_refused(tmp_path: Path, twin: str) -> None:
    torch.set_num_threads(1)
    data = _arithmetic_chats(tmp_path / "train.jsonl", 16)

    def config(name: str, max_steps: int, resume: bool = False) -> SFTConfig:
        return SFTConfig(
            model=ModelConfig(name=name, dtype="float32"),
            output_dir=tmp_path / "run",
            data=data,
            max_steps=max_steps,
            batch_size=8,
            micro_batch_size=8,
            seq_len=64,
            optim=OptimConfig(lr=1e-3),
            ckpt=CheckpointConfig(resume=resume),
        )

    assert run_sft(config(TINY, 1)) == 0
    with pytest.raises(ValueError) as info:
        run_sft(config(twin, 2, resume=True))
    message = str(info.value)
    assert "\n" not in message and repr(TINY) in message and repr(twin) in message, message
    assert not (sft_dir(tmp_path / "run") / "checkpoints" / "step_2").exists()

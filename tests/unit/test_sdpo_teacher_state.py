"""The SDPO teacher's state: an fp32 EMA master under bf16 weights, and exact resume from checkpoints.

EMA values are checked against the closed form of a repeated average toward a fixed target,
``t_n = p + (t_0 - p) * rate**n``, computed in float64. Resume is checked like
``tests/unit/test_checkpoint.py`` checks the policy: N trainer steps straight against k steps, a
checkpoint, a fresh ``Trainer`` resumed from it, and N - k more steps; the teacher's weights (and
its fp32 master) must be bit-identical.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch import nn

from prime_composer.config.base import CheckpointConfig, ModelConfig
from prime_composer.config.loss import LossConfig, SDPOLossConfig
from prime_composer.config.optim import OptimConfig
from prime_composer.config.trainer import TrainerConfig
from prime_composer.orchestrator.packing import pack_step
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.sdpo.packing import SDPOPacker
from prime_composer.orchestrator.sdpo.target import set_sdpo_target
from prime_composer.orchestrator.state import OrchestratorState
from prime_composer.trainer.model import World
from prime_composer.trainer.policy_copy import PolicyCopy
from prime_composer.trainer.train import Trainer

WORLD = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
NUM_STEPS = 4


def test_bf16_ema_keeps_an_fp32_master():
    # One bf16 ulp above 1.0 is 2**-7. Each update moves the average 1% of the remaining gap
    # (7.8e-5 at first), less than half an ulp: a bf16 average would stay at 1.0 forever.
    policy = nn.Linear(1, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        policy.weight.fill_(1.0)
    teacher = PolicyCopy(policy, "ema", ema_rate=0.99)
    assert teacher.master["weight"].dtype == torch.float32
    assert teacher.module.weight.dtype == torch.bfloat16
    target = 1.0 + 2**-7
    with torch.no_grad():
        policy.weight.fill_(target)
    for _ in range(100):
        teacher.update(policy)
    expected = target + (1.0 - target) * 0.99**100  # 1.004950..., float64
    assert teacher.master["weight"].item() == pytest.approx(expected, abs=1e-6)
    # The forward weights are the master rounded to bf16 (1.00495 is nearer 1 + 2**-7 than 1).
    assert teacher.module.weight.item() == target
    # In bf16 alone the same updates would not have moved it.
    bf16_average = torch.ones((), dtype=torch.bfloat16)
    for _ in range(100):
        bf16_average.lerp_(torch.tensor(target, dtype=torch.bfloat16), 0.01)
    assert bf16_average.item() == 1.0


def test_fp32_ema_and_frozen_keep_no_master():
    policy = nn.Linear(2, 2)
    assert PolicyCopy(policy, "ema").master == {}
    assert PolicyCopy(policy.to(torch.bfloat16), "frozen").master == {}


def test_state_dict_round_trip_and_kind_check():
    policy = nn.Linear(2, 2).to(torch.bfloat16)
    teacher = PolicyCopy(policy, "ema", ema_rate=0.5)
    with torch.no_grad():
        policy.weight.add_(1.0)
    teacher.update(policy)
    saved = {"kind": "ema", "weights": {k: v.clone() for k, v in teacher.state_dict()["weights"].items()}}
    assert saved["weights"]["weight"].dtype == torch.float32  # the master, not the bf16 copy
    fresh = PolicyCopy(nn.Linear(2, 2).to(torch.bfloat16), "ema", ema_rate=0.5)
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.master["weight"], teacher.master["weight"])
    assert torch.equal(fresh.module.weight, teacher.module.weight)
    frozen = PolicyCopy(nn.Linear(2, 2), "frozen")
    with pytest.raises(ValueError, match=r"policy copy is 'ema' but this run needs 'frozen'"):
        frozen.load_state_dict(saved)


# ------------------------------------------------------------------------------ trainer resume


def _micro_batches() -> list:
    rng = random.Random(0)
    samples = []
    for i in range(4):
        prompt = [rng.randint(3, 400) for _ in range(6)]
        completion = [rng.randint(3, 400) for _ in range(5)]
        s = Sample(
            prompt_ids=prompt,
            completion_ids=completion,
            completion_logprobs=[-1.0] * len(completion),
            completion_mask=[1] * len(completion),
            reward=float(i % 2),
            example_id=i,
            group_id=0,
            policy_step=0,
            advantage=1.0 if i % 2 else -1.0,
        )
        set_sdpo_target(s, (1, len(completion)), prompt + [rng.randint(3, 400) for _ in range(3)])
        samples.append(s)
    (mbs,), _ = pack_step(samples, 32, 2, 1, pad_token_id=0, packers=[SDPOPacker()])
    return mbs


def _trainer(output_dir: Path, teacher: str, dtype: str) -> Trainer:
    sdpo = SDPOLossConfig(weight=1.0, teacher=teacher, **({"ema_rate": 0.5} if teacher == "ema" else {}))
    config = TrainerConfig(
        model=ModelConfig(name="builtin:tiny-qwen3", dtype=dtype),
        output_dir=output_dir,
        max_steps=NUM_STEPS,
        optim=OptimConfig(lr=1e-2),
        loss=LossConfig(sdpo=sdpo),
        ckpt=CheckpointConfig(resume=True),
    )
    return Trainer(config, WORLD)


def _save(trainer: Trainer, step: int) -> None:
    """The trainer's part of a checkpoint, plus the orchestrator's (empty) part that resume also waits for."""
    trainer.save_checkpoint(step)
    root = trainer.config.output_dir / "checkpoints"
    OrchestratorState(step=step).save(root, keep=5)


def _teacher(trainer: Trainer) -> PolicyCopy:
    (teacher,) = trainer.terms_context.copies.values()
    return teacher


def _teacher_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    teacher = _teacher(trainer)
    state = {f"module.{k}": v.detach().clone() for k, v in teacher.module.state_dict().items()}
    return state | {f"master.{k}": v.clone() for k, v in teacher.master.items()}


@pytest.mark.parametrize(
    ("teacher", "dtype"), [("ema", "bfloat16"), ("ema", "float32"), ("frozen", "float32")]
)
def test_resume_restores_the_teacher_exactly(tmp_path, teacher, dtype):
    torch.set_num_threads(1)  # same kernels and reduction order in every run
    mbs = _micro_batches()

    straight = _trainer(tmp_path / "straight", teacher, dtype)
    initial = {k: v.detach().clone() for k, v in straight.model.state_dict().items()}
    for _ in range(NUM_STEPS):
        straight.step(mbs)

    interrupted = _trainer(tmp_path / "resumed", teacher, dtype)
    for _ in range(2):
        interrupted.step(mbs)
    _save(interrupted, 2)
    del interrupted

    resumed = _trainer(tmp_path / "resumed", teacher, dtype)
    resumed.resume()
    assert resumed.start_step == 2
    for _ in range(NUM_STEPS - 2):
        resumed.step(mbs)

    expected, got = _teacher_state(straight), _teacher_state(resumed)
    assert got.keys() == expected.keys()
    assert any(k.startswith("master.") for k in got) == (dtype == "bfloat16" and teacher == "ema")
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    policy = resumed.model.state_dict()
    if teacher == "frozen":
        # Still the run's initial weights, not the resumed policy's.
        for name, tensor in _teacher(resumed).module.state_dict().items():
            assert torch.equal(tensor, initial[name]), name
        assert not torch.equal(policy["model.norm.weight"], initial["model.norm.weight"])
    else:
        # The EMA moved, and is not the policy either.
        assert not torch.equal(got["module.model.norm.weight"], initial["model.norm.weight"])
        assert not torch.equal(got["module.model.norm.weight"], policy["model.norm.weight"])


def test_resume_without_teacher_state_is_a_clear_error(tmp_path):
    torch.set_num_threads(1)
    first = _trainer(tmp_path, "live", "float32")
    _save(first, 1)
    with pytest.raises(ValueError, match=r"no \['policy_copy_ema'\] state.*resume with the settings"):
        _trainer(tmp_path, "ema", "float32").resume()

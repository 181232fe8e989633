"""One rank of ``test_sdpo_fsdp.py`` (``torchrun --nproc-per-node 2``): the SDPO teacher under FSDP2.

1. An EMA teacher is made for a sharded policy the way the trainer makes it (load + shard a copy,
   then copy the policy's local shards in). The policy's weights are scaled by 1.1 on the local
   shards, the teacher is updated, and rank 0 writes the gathered full weights of both.
2. Rank 0 has a hinted sample, rank 1 none: ``SDPOTerm`` must still run a teacher forward on both
   (FSDP all-gathers parameters inside it) and rank 0 writes its teacher logits.

    torchrun --standalone --nproc-per-node 2 tests/integration/sdpo_fsdp_worker.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from prime_composer.config.base import ModelConfig
from prime_composer.config.loss import SDPOLossConfig
from prime_composer.orchestrator.packing import pack_step
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.sdpo.packing import SDPOPacker
from prime_composer.orchestrator.sdpo.target import set_sdpo_target
from prime_composer.trainer.losses.sdpo_term import SDPOTerm
from prime_composer.trainer.model import (
    close_distributed,
    full_state_dict,
    init_distributed,
    load_model,
    shard_model,
)
from prime_composer.trainer.policy_copy import PolicyCopy

MODEL = ModelConfig(name="builtin:tiny-qwen3", dtype="float32")
RATE = 0.75
PROMPT = [5, 6, 7, 8, 9]
COMPLETION = [20, 21, 22, 23]
TEACHER_PREFIX = [5, 6, 7, 8, 9, 30, 31, 32]


def hinted_sample() -> Sample:
    s = Sample(
        prompt_ids=PROMPT,
        completion_ids=COMPLETION,
        completion_logprobs=[-1.0] * 4,
        completion_mask=[1] * 4,
        reward=0.0,
        example_id=0,
        group_id=0,
        policy_step=0,
    )
    set_sdpo_target(s, (1, 4), TEACHER_PREFIX)
    return s


def main(out: Path) -> None:
    torch.set_num_threads(1)
    world = init_distributed()
    assert world.world_size == 2, world
    policy = shard_model(load_model(MODEL, world.device)[0], world, mixed_precision=False)
    cfg = SDPOLossConfig(weight=1.0, teacher="ema", ema_rate=RATE)
    teacher = PolicyCopy(
        policy,
        "ema",
        ema_rate=RATE,
        make_copy=lambda: shard_model(load_model(MODEL, world.device)[0], world, False),
    )
    before = full_state_dict(teacher.module)
    with torch.no_grad():
        for p in policy.parameters():
            p.to_local().mul_(1.1)
    teacher.update(policy)
    policy_full, teacher_full = full_state_dict(policy), full_state_dict(teacher.module)

    plain = Sample(
        prompt_ids=PROMPT,
        completion_ids=COMPLETION,
        completion_logprobs=[-1.0] * 4,
        completion_mask=[1] * 4,
        reward=0.0,
        example_id=1,
        group_id=1,
        policy_step=0,
    )
    samples = [hinted_sample()] if world.rank == 0 else [plain]
    (mbs,), _ = pack_step(samples, 16, 1, 1, pad_token_id=0, packers=[SDPOPacker()])
    term = SDPOTerm(cfg, teacher)
    term.begin_step(mbs)
    term.prepare(0, mbs[0])
    logits = term._teacher_logits
    if world.rank == 0:
        torch.save(
            {
                "before": before,
                "policy": policy_full,
                "teacher": teacher_full,
                "logits": logits,
                "normalizer": term.normalizer,
                "run_teacher": term._run_teacher,
                "num_forwards": teacher.num_forwards,
            },
            out / "rank0.pt",
        )
    else:
        torch.save({"logits": logits, "run_teacher": term._run_teacher}, out / "rank1.pt")
    close_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))

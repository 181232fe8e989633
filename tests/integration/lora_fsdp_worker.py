"""One rank of ``test_lora_fsdp.py`` (``torchrun --nproc-per-node 2``), or the unsharded reference
(``python lora_fsdp_worker.py OUT``): two steps of the real ``Trainer`` with LoRA and a KL
reference (a sharded frozen copy, adapters included), each followed by the adapter publish, then
a checkpoint and the merged final export. Rank 0 writes the losses and grad norms to
``<out>/result.pt``; the published adapters and the export are under ``<out>/run``.

    torchrun --standalone --nproc-per-node 2 tests/integration/lora_fsdp_worker.py OUT
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

from prime_composer.config.trainer import TrainerConfig
from prime_composer.orchestrator.packing import pack_step
from prime_composer.orchestrator.sample import Sample
from prime_composer.trainer.export import export_final
from prime_composer.trainer.model import close_distributed, init_distributed
from prime_composer.trainer.train import Trainer
from prime_composer.transport.batch import MicroBatch

NUM_STEPS = 2


def config(out: Path) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "model": {"name": "builtin:tiny-qwen3", "dtype": "float32", "lora": {"rank": 4, "alpha": 8.0}},
            "output_dir": str(out / "run"),
            "max_steps": NUM_STEPS,
            "optim": {"lr": 1e-2},
            "loss": {"rl": {"kl_coef": 0.05}},
            "ckpt": {"parts": ["trainer"]},
        }
    )


def packed(num_ranks: int, step: int) -> list[list[MicroBatch]]:
    rng = random.Random(step)
    samples = []
    for i in range(8):
        prompt = [rng.randint(3, 400) for _ in range(rng.randint(3, 7))]
        completion = [rng.randint(3, 400) for _ in range(rng.randint(3, 8))]
        samples.append(
            Sample(
                prompt_ids=prompt,
                completion_ids=completion,
                completion_logprobs=[-rng.uniform(4.0, 8.0) for _ in completion],
                completion_mask=[1] * len(completion),
                reward=float(i % 2),
                example_id=i // 2,
                group_id=i // 2,
                policy_step=0,
                advantage=rng.uniform(-1, 1),
            )
        )
    rank_batches, _ = pack_step(samples, 32, 1, num_ranks, pad_token_id=0)
    return rank_batches


def main(out: Path) -> None:
    torch.set_num_threads(1)
    world = init_distributed()
    trainer = Trainer(config(out), world)
    losses, grad_norms = [], []
    for step in range(NUM_STEPS):
        metrics = trainer.step(packed(world.world_size, step)[world.rank], step)
        trainer.publish(step + 1)
        losses.append(metrics["loss/total"])
        grad_norms.append(metrics["grad_norm"])
    trainer.save_checkpoint(NUM_STEPS)
    export_final(trainer.model, trainer.tokenizer, out / "run", world, lora="merged")
    if world.is_main:
        torch.save({"losses": losses, "grad_norms": grad_norms}, out / "result.pt")
    close_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))

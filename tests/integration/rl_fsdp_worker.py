"""One rank of ``test_fsdp_rl.py`` (``torchrun --nproc-per-node 2``): the RL trainer step, sharded.

Every loss term is on: RL with the KL reference (a frozen sharded copy) and SDPO with an EMA
teacher (another sharded copy). Each rank trains on its own micro-batches of the same packed step;
rank 0 writes the gathered full gradients, the step's loss and metrics to ``<out>/<mode>.pt``, for
each mode given (``defer``: the gradient reduce-scatter deferred to the last micro-batch;
``every``: after every micro-batch), each from freshly loaded weights, in one launch (a torchrun
start-up costs more than the steps).

    torchrun --standalone --nproc-per-node 2 tests/integration/rl_fsdp_worker.py OUT MODE [MODE...]
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

from prime_composer.config.base import ModelConfig
from prime_composer.config.loss import LossConfig
from prime_composer.orchestrator.packing import pack_step
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.sdpo.packing import SDPOPacker
from prime_composer.orchestrator.sdpo.target import set_sdpo_target
from prime_composer.trainer.losses.base import TermContext, build_terms
from prime_composer.trainer.model import World, close_distributed, init_distributed, load_model, shard_model
from prime_composer.trainer.step import train_step
from prime_composer.transport.batch import MicroBatch

MODEL = ModelConfig(name="builtin:tiny-qwen3", dtype="float32")
LOSS = LossConfig(rl={"kl_coef": 0.05}, sdpo={"weight": 0.3, "teacher": "ema", "ema_rate": 0.5})
SEQ_LEN = 32


def samples() -> list[Sample]:
    rng = random.Random(5)
    out = []
    for i in range(10):
        prompt = [rng.randint(3, 400) for _ in range(rng.randint(3, 7))]
        completion = [rng.randint(3, 400) for _ in range(rng.randint(3, 8))]
        s = Sample(
            prompt_ids=prompt,
            completion_ids=completion,
            completion_logprobs=[-rng.uniform(0.5, 8.0) for _ in completion],
            completion_mask=[1] * len(completion),
            reward=float(i % 2),
            example_id=i // 2,
            group_id=i // 2,
            policy_step=0,
            advantage=rng.uniform(-1, 1),
        )
        if i % 3 == 0:
            hint = [rng.randint(3, 400) for _ in range(3)]
            set_sdpo_target(s, (1, len(completion)), prompt + completion[:1] + hint)
        out.append(s)
    return out


def packed(num_ranks: int) -> list[list[MicroBatch]]:
    rank_batches, _ = pack_step(samples(), SEQ_LEN, 1, num_ranks, pad_token_id=0, packers=[SDPOPacker()])
    return rank_batches


def step(world: World, defer: bool) -> dict[str, object]:
    """One sharded step from freshly loaded weights; rank 0's gathered full gradients."""
    model = shard_model(load_model(MODEL, torch.device("cpu"))[0], world, mixed_precision=False)
    context = TermContext(
        model,
        make_copy=lambda: shard_model(load_model(MODEL, torch.device("cpu"))[0], world, False),
        world_size=world.world_size,
    )
    terms = build_terms(LOSS, context)
    result = train_step(
        model, packed(2)[world.rank], terms, world.device, world.world_size, defer_grad_sync=defer
    )
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    return {"grads": grads, "loss": result.loss, "metrics": result.metrics}


def main(out: Path, modes: list[str]) -> None:
    torch.set_num_threads(1)
    world = init_distributed()
    assert world.world_size == 2, world
    for mode in modes:
        assert mode in ("defer", "every"), mode
        result = step(world, defer=mode == "defer")
        if world.is_main:
            torch.save(result, out / f"{mode}.pt")
    close_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])

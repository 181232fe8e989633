"""One rank of ``test_fsdp.py`` (run under ``torchrun --nproc-per-node 2``): a sharded SFT step.

Each rank takes its half of the global batch (``rank_micro_batches``, two micro-batches each),
runs forward/backward with the step's global token count, then rank 0 writes to ``<out>/``:
the full gradients (gathered from DTensor shards), the clipped-norm value, and the updated full
weights; all ranks also write a 2-rank DCP checkpoint and an exported HF directory for the
test to load in one process.

    torchrun --standalone --nproc-per-node 2 tests/integration/fsdp_worker.py DATA OUT [BENCH_STEPS]

With ``BENCH_STEPS`` > 0 it then times that many more steps and prints the mean step time.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch

from prime_composer.config.base import ModelConfig
from prime_composer.config.optim import OptimConfig
from prime_composer.trainer.checkpoint import CheckpointManager
from prime_composer.trainer.export import save_hf_directory
from prime_composer.trainer.model import (
    close_distributed,
    full_state_dict,
    init_distributed,
    load_model,
    shard_model,
)
from prime_composer.trainer.optim import build_optimizer, clip_grad_norm
from prime_composer.trainer.sft import rank_micro_batches, token_loss_sum, train_step
from prime_composer.trainer.sft_data import load_sft_samples

MODEL = ModelConfig(name="builtin:tiny-qwen3", dtype="float32")
# eps = lr: Adam's first update lr * g / (|g| + eps) is then a smooth function of g, so the
# rounding differences of a reduce-scatter cannot flip the sign of near-zero gradients' updates.
OPTIM = OptimConfig(lr=1e-3, eps=1e-3, weight_decay=0.1, max_grad_norm=1.0)
MICRO_BATCH_SIZE = 2
NUM_SAMPLES = 8  # 2 ranks x 2 micro-batches x 2


def write_data(path: Path) -> Path:
    """The step's chat samples (additions of varied prompt lengths) as JSONL at ``path``."""
    rng = random.Random(11)
    with path.open("w") as f:
        for _ in range(NUM_SAMPLES):
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            user = {"role": "user", "content": f"Compute {a} plus {b}" + " please" * rng.randint(0, 4)}
            f.write(json.dumps({"messages": [user, {"role": "assistant", "content": str(a + b)}]}) + "\n")
    return path


def main(data: Path, out: Path, bench_steps: int) -> None:
    torch.set_num_threads(1)
    world = init_distributed()
    assert world.world_size == 2, world
    model, tokenizer = load_model(MODEL, torch.device("cpu"))
    model = shard_model(model, world, mixed_precision=False)
    optimizer, scheduler = build_optimizer(model, OPTIM, max_steps=1 + bench_steps)
    samples = load_sft_samples(data, tokenizer, seq_len=64)
    num_loss_tokens = sum(s.num_loss_tokens for s in samples)

    micro_batches = rank_micro_batches(samples, world, MICRO_BATCH_SIZE, tokenizer.pad_token_id)
    for i, batch in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        (token_loss_sum(model, batch, world.device) * (world.world_size / num_loss_tokens)).backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    norm = clip_grad_norm(model, OPTIM.max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    weights = full_state_dict(model)
    if world.is_main:
        torch.save({"grads": grads, "norm": norm, "weights": weights}, out / "rank0.pt")
    else:
        assert weights == {}, "full_state_dict must be empty on ranks other than 0"

    CheckpointManager(out / "checkpoints", keep=1, world=world).save(1, model, optimizer, scheduler)
    save_hf_directory(model, tokenizer, out / "final", world)

    if bench_steps:
        times = []
        for _ in range(bench_steps):
            started = time.perf_counter()
            train_step(
                model, optimizer, scheduler, micro_batches, num_loss_tokens, world, OPTIM.max_grad_norm
            )
            times.append(time.perf_counter() - started)
        if world.is_main:
            num_tokens = sum(len(s.input_ids) for s in samples)
            mean = sum(times) / len(times)
            print(f"fsdp2 2 ranks: {mean * 1000:.1f} ms/step, {num_tokens / mean:.0f} tokens/s", flush=True)
    close_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 0)

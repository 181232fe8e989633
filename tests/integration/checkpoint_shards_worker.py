"""One rank of ``test_checkpoint_shards.py`` (``torchrun --nproc-per-node 2``): save a sharded
checkpoint, then rank 0 flips one byte of rank 1's DCP shard and every rank tries to load it.

    torchrun --standalone --nproc-per-node 2 tests/integration/checkpoint_shards_worker.py OUT

Each rank writes ``OUT/rank_<R>.json``: the error its load raised (or none).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from prime_composer.integrity import IntegrityError
from prime_composer.trainer.checkpoint import CheckpointManager
from prime_composer.trainer.model import close_distributed, init_distributed


def main(out: Path) -> None:
    torch.set_num_threads(1)
    world = init_distributed()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    mesh = init_device_mesh("cpu", (world.world_size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    manager = CheckpointManager(out / "checkpoints", keep=1, world=world)
    manager.save(1, model, optimizer, scheduler)
    manager.load(1, model, optimizer, scheduler)  # intact: loads on every rank
    if world.is_main:
        (shard,) = (out / "checkpoints" / "step_1" / "trainer" / "model_optim").glob("__1_*.distcp")
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    world.barrier()
    error = None
    try:
        manager.load(1, model, optimizer, scheduler)
    except IntegrityError as e:
        error = str(e)
    (out / f"rank_{world.rank}.json").write_text(json.dumps({"error": error}))
    close_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""The ranks of ``test_hsdp.py`` (run under ``torchrun --nproc-per-node 4``): the real ``Trainer``
four times in one process group, on the batches the test wrote into each run directory.

- ``fsdp``: FSDP2 over the 4 ranks, 3 steps, a checkpoint of step 2;
- ``hsdp``: HSDP 2 x 2 (``trainer.parallel.replicate = 2``), the same;
- ``hsdp_resumed``: HSDP resumed from ``hsdp``'s checkpoint of step 2 (copied into its directory);
- ``hsdp_from_fsdp``: HSDP resumed from ``fsdp``'s checkpoint of step 2 (DCP reshards 4 -> 2 x 2).

Each run leaves ``metrics/trainer.jsonl`` and ``broadcasts/step_<N>/``; rank 0 also writes
``layout.json``: the mesh and the local shard of the embedding, which show the layout that ran.

    torchrun --standalone --nproc-per-node 4 tests/integration/hsdp_worker.py ROOT
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

from prime_composer.config.trainer import TrainerConfig
from prime_composer.trainer.model import close_distributed, init_distributed
from prime_composer.trainer.train import Trainer

NUM_RANKS = 4
MAX_STEPS = 3
CKPT_STEP = 2


def trainer_config(output_dir: Path, replicate: int, resume_step: int | None = None) -> TrainerConfig:
    """The runs' trainer config (``replicate = 1``: FSDP2; with ``num_ranks = 1``: the reference)."""
    return TrainerConfig.model_validate(
        {
            "model": {"name": "builtin:tiny-qwen3", "dtype": "float32"},
            "output_dir": str(output_dir),
            "max_steps": MAX_STEPS,
            "num_ranks": NUM_RANKS,
            "parallel": {"replicate": replicate},
            # eps = lr: Adam's first updates are then smooth in the gradient, so the rounding of a
            # different reduction order cannot flip the sign of a near-zero gradient's update.
            # max_grad_norm (0.2) small enough that every step clips.
            "optim": {"lr": 1e-3, "eps": 1e-3, "max_grad_norm": 0.2},
            "ckpt": {
                "interval": CKPT_STEP,
                "at_end": False,
                "parts": ["trainer"],
                "resume_step": resume_step,
            },
            "export_final": False,
            "num_threads": 1,
        }
    )


def _layout(trainer: Trainer) -> dict[str, object]:
    embed = trainer.model.get_input_embeddings().weight
    return {
        "mesh": list(embed.device_mesh.shape),
        "placements": [str(p) for p in embed.placements],
        "full_rows": embed.shape[0],
        "local_rows": embed.to_local().shape[0],
    }


def main(root: Path) -> None:
    torch.set_num_threads(1)
    world = init_distributed()
    assert world.world_size == NUM_RANKS, world
    for name, replicate, resume_from in (
        ("fsdp", 1, None),
        ("hsdp", 2, None),
        ("hsdp_resumed", 2, "hsdp"),
        ("hsdp_from_fsdp", 2, "fsdp"),
    ):
        run = root / name
        if resume_from is not None and world.is_main:
            step = f"step_{CKPT_STEP}"
            shutil.copytree(root / resume_from / "checkpoints" / step, run / "checkpoints" / step)
        world.barrier()
        trainer = Trainer(trainer_config(run, replicate, CKPT_STEP if resume_from else None), world)
        if resume_from is not None:
            trainer.resume()
        if world.is_main:
            (run / "layout.json").write_text(json.dumps(_layout(trainer)))
        trainer.run()
        del trainer
    close_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))

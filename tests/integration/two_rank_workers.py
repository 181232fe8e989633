"""The 2-rank FSDP2 workers of the integration tests in one ``torchrun``: each torchrun start-up
(an agent and two ranks importing torch and transformers) costs more than the steps it runs.

    torchrun --standalone --nproc-per-node 2 tests/integration/two_rank_workers.py ROOT

Runs, in one process group and in this order, each worker's ``main`` into ``ROOT/<part>/``:
``fsdp`` (``fsdp_worker.py``, on the data that ``fsdp_worker.write_data`` writes),
``rl_fsdp`` (``rl_fsdp_worker.py``, both modes), ``sdpo_fsdp``, ``lora_fsdp`` (its sharded run),
``checkpoint_shards`` and ``loss_global_normalizer`` (the checks of that test file, run on the
ranks). Between parts the process group stays up (a worker's
``close_distributed`` becomes a barrier: a re-created default group would reuse the store's keys)
and torch's RNG is put back to this process's start state, so every part starts as it would in a
process of its own. A part that raises writes ``ROOT/<part>/error-rank<N>.txt`` and ends the launch;
a finished part writes ``ROOT/<part>/done``. ``tests/integration/conftest.py``'s ``two_rank_runs``
runs this once per test run.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import checkpoint_shards_worker
import fsdp_worker
import lora_fsdp_worker
import rl_fsdp_worker
import sdpo_fsdp_worker
import test_loss_global_normalizer

from prime_composer.trainer.model import close_distributed, init_distributed

WORKERS = (fsdp_worker, rl_fsdp_worker, sdpo_fsdp_worker, lora_fsdp_worker, checkpoint_shards_worker)


def parts() -> dict[str, Callable[[Path], None]]:
    """Each part's name and its run into its folder."""
    return {
        "fsdp": lambda out: fsdp_worker.main(out / "data.jsonl", out, 0),
        "rl_fsdp": lambda out: rl_fsdp_worker.main(out, ["defer", "every"]),
        "sdpo_fsdp": sdpo_fsdp_worker.main,
        "lora_fsdp": lora_fsdp_worker.main,
        "checkpoint_shards": checkpoint_shards_worker.main,
        "loss_global_normalizer": test_loss_global_normalizer.check_on_two_ranks,
    }


def main(root: Path) -> None:
    world = init_distributed()
    assert world.world_size == 2, world
    for module in WORKERS:
        module.close_distributed = world.barrier  # type: ignore[attr-defined]
    start_rng = torch.random.get_rng_state()
    for name, run in parts().items():
        out = root / name
        if world.is_main:
            out.mkdir(parents=True, exist_ok=True)
            if name == "fsdp":
                fsdp_worker.write_data(out / "data.jsonl")
        world.barrier()
        torch.random.set_rng_state(start_rng)
        try:
            run(out)
        except BaseException:
            (out / f"error-rank{world.rank}.txt").write_text(traceback.format_exc())
            raise
        world.barrier()
        if world.is_main:
            (out / "done").touch()
    close_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))

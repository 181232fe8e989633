"""``trainer``: run the trainer alone from its config.

    uv run trainer @ outputs/run/configs/trainer.json
    uv run torchrun --nproc-per-node 2 -m prime_composer.trainer.main @ trainer.json

(``rl`` starts it, under torchrun when ``trainer.num_ranks > 1``; see ``train.py``.)
"""

from __future__ import annotations

import os

from prime_composer.config.cli import exit_process, run_entry_point
from prime_composer.config.trainer import TrainerConfig
from prime_composer.logs import setup_logging


def run(config: TrainerConfig) -> int:
    rank = os.environ.get("RANK")
    setup_logging("trainer" if rank in (None, "0") else f"trainer[{rank}]")
    from prime_composer.trainer.train import train

    train(config)
    return 0


def main() -> None:
    exit_process(
        run_entry_point(
            TrainerConfig,
            run,
            prog="trainer",
            env_prefix="PRIME_COMPOSER_TRAINER__",
            describe="Train on the orchestrator's batches and publish weights after every step.",
        )
    )


if __name__ == "__main__":
    main()

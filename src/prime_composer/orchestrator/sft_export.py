"""Write SFT warm-up data from the orchestrator's environments: one chat per line (JSONL).

    python -m prime_composer.orchestrator.sft_export --config <orchestrator.json> --out data.jsonl

Each line is ``{"messages": [...prompt..., {"role": "assistant", "content": <reference>}]}`` for
a task of the train split (never the held-out split), cycling over the tasks in a seeded order
until ``--num-examples`` lines are written. Environments with tools give their reference episodes
instead: every reply and tool result as messages, plus the ``tools`` the chat template renders
(``envs.sft_records``). The ``rl`` launcher runs it before the ``sft`` stage when ``[warmup]`` is
on and no data file is given.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from prime_composer.config.cli import load_file
from prime_composer.config.orchestrator import OrchestratorConfig
from prime_composer.io import atomic_write_text
from prime_composer.logs import setup_logging


def export_sft_data(config: OrchestratorConfig, out: Path, num_examples: int) -> int:
    """Write ``num_examples`` conversations to ``out``; returns how many distinct tasks were used."""
    from prime_composer.orchestrator.envs import load_envs, sft_records

    envs = load_envs(config.env, config.rollout)
    records = [record for loaded in envs for record in sft_records(loaded, "train")]
    if not records:
        raise ValueError("orchestrator.env: the train split has no tasks to build SFT data from")
    rng = random.Random(config.seed)
    lines: list[str] = []
    while len(lines) < num_examples:
        order = list(range(len(records)))
        rng.shuffle(order)
        lines += [json.dumps(records[i]) for i in order[: num_examples - len(lines)]]
    atomic_write_text(out, "\n".join(lines) + "\n")
    return len(records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", type=Path, required=True, help="the orchestrator's resolved config (JSON)"
    )
    parser.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    parser.add_argument("--num-examples", type=int, default=1000)
    parser.add_argument(
        "--seed", type=int, default=None, help="draw with this seed (default: the config's seed)"
    )
    args = parser.parse_args()
    logger = setup_logging("sft-data")
    config = OrchestratorConfig.model_validate(load_file(args.config, origin="--config").values)
    if args.seed is not None:
        config = config.model_copy(update={"seed": args.seed})
    num_tasks = export_sft_data(config, args.out, args.num_examples)
    logger.info("wrote %d conversations from %d tasks to %s", args.num_examples, num_tasks, args.out)


if __name__ == "__main__":
    main()

"""The orchestrator's resumable state, checkpointed next to the trainer's.

Everything that decides which batch comes next is a counter, so the state is a few integers
(no RNG objects to pickle): the step about to be produced, how many groups were consumed in total
(each group's number seeds its sampling), how many tasks each environment has handed out (the
task order is a seeded permutation per epoch), and the batch sources' positions. The same class
holds the draw position, which runs ahead of the consumed one while groups are in flight
(``stream.py``); checkpoints hold the consumed one.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prime_composer.checkpoint_layout import DEFAULT_PARTS, StepCheckpoints, step_dir
from prime_composer.integrity import verify_manifest
from prime_composer.io import atomic_write_text

PART = "orchestrator"


@dataclass
class OrchestratorState:
    step: int = 0
    """The next step to produce a batch for."""
    groups_drawn: int = 0
    """Groups drawn so far over the whole run (the next group's id)."""
    env_draws: list[int] = field(default_factory=list)
    """Tasks drawn so far from each environment."""
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each channel's checkpoint state (``OrchestratorChannel.state_dict``, non-empty ones), by name."""

    def save(self, ckpt_root: Path, keep: int, parts: tuple[str, ...] = DEFAULT_PARTS) -> None:
        """Publish ``step_<N>/orchestrator/state.json`` (with its manifest and marker) through the
        run's one checkpoint manager, which commits the step once every one of ``parts`` (the run's
        ``ckpt.parts``; the trainer's marker adds any this process does not know of) is written and
        keeps the newest ``keep`` complete steps. A failed write is a ``CheckpointWriteError``."""

        def write(tmp: Path) -> None:
            atomic_write_text(tmp / "state.json", json.dumps(asdict(self), indent=2) + "\n")

        StepCheckpoints(ckpt_root, keep, tuple(dict.fromkeys((PART, *parts)))).write_part(
            self.step, PART, write
        )

    @classmethod
    def load(cls, ckpt_root: Path, step: int) -> OrchestratorState:
        """The state of ``step``, after checking it against its manifest (``IntegrityError`` if not)."""
        directory = step_dir(ckpt_root, step) / PART
        verify_manifest(directory)
        data = json.loads((directory / "state.json").read_text())
        return cls(**data)


def task_index(seed: int, env_index: int, draw: int, num_tasks: int) -> int:
    """Task handed out by environment ``env_index`` at its ``draw``-th draw: one seeded
    permutation of all tasks per epoch, so every task is seen once per epoch."""
    epoch, position = divmod(draw, num_tasks)
    return _epoch_order(seed, env_index, epoch, num_tasks)[position]


@functools.lru_cache(maxsize=8)
def _epoch_order(seed: int, env_index: int, epoch: int, num_tasks: int) -> tuple[int, ...]:
    order = list(range(num_tasks))
    random.Random(f"{seed}/{env_index}/{epoch}").shuffle(order)
    return tuple(order)


def choose_env(seed: int, group_id: int, ratios: list[float]) -> int:
    """Environment of group ``group_id``, drawn with the configured ratios (seeded by the id)."""
    if len(ratios) == 1:
        return 0
    return random.Random(f"{seed}/env/{group_id}").choices(range(len(ratios)), weights=ratios)[0]

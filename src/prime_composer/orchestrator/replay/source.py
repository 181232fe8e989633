"""Pairs for each step from the teacher service's pair store, in cursor order, none twice.

The pairs come through the teacher client (``teacher/client.py``: ``take_pairs(n, after_cursor)``);
the cursor of the last pair taken is this source's whole position, saved in the orchestrator's
checkpoint, so a resumed run takes exactly the pairs the interrupted one had not. A step with no
ready pair trains without the channel (counted in ``replay/pairs``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prime_composer.config.orchestrator import ReplaySourceConfig
from prime_composer.teacher.client import Pair, TeacherClient
from prime_composer.transport.groups import DPOGroup


class PairSource:
    """``BatchSource`` of the replay pairs."""

    name = DPOGroup.name

    def __init__(
        self, cfg: ReplaySourceConfig, output_dir: Path, teacher: TeacherClient | None = None
    ) -> None:
        self.cfg = cfg
        self.teacher = teacher or TeacherClient(store_path(cfg, output_dir))
        self.cursor = 0
        self._taken = 0

    async def take(self, step: int) -> list[Any]:
        pairs: list[Pair] = self.teacher.take_pairs(self.cfg.pairs_per_step, after_cursor=self.cursor)
        if pairs:
            self.cursor = pairs[-1].cursor
        self._taken = len(pairs)
        return list(pairs)

    def metrics(self) -> dict[str, float]:
        return {"replay/pairs": self._taken, "replay/cursor": self.cursor}

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor = int(state.get("cursor", 0))


def store_path(cfg: ReplaySourceConfig, output_dir: Path) -> Path:
    """The teacher service's store: ``orchestrator.replay.store``, else the run's own."""
    return cfg.store or Path(output_dir) / "teacher" / "teacher.sqlite"

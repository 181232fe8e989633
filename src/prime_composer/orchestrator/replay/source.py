"""Pairs for each step from the teacher service's pair store, in cursor order, none twice.

The store is the service's SQLite file (``teacher/pairs.py``: ``PairStore.take(n, after_cursor)``);
the cursor of the last pair taken is this source's whole position, saved in the orchestrator's
checkpoint, so a resumed run takes exactly the pairs the interrupted one had not. A step with no
ready pair trains without the channel (counted in ``replay/pairs``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prime_composer.config.orchestrator import ReplaySourceConfig
from prime_composer.teacher.pairs import Pair, PairStore
from prime_composer.transport.groups import DPOGroup


class PairSource:
    """``BatchSource`` of the replay pairs."""

    name = DPOGroup.name

    def __init__(self, cfg: ReplaySourceConfig, output_dir: Path) -> None:
        self.cfg = cfg
        self.store = PairStore(cfg.store or Path(output_dir) / "teacher" / "teacher.sqlite")
        self.cursor = 0
        self._taken = 0

    async def take(self, step: int) -> list[Any]:
        pairs: list[Pair] = self.store.take(self.cfg.pairs_per_step, after_cursor=self.cursor)
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

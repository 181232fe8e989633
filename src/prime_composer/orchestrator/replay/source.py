"""Pairs for each step from the teacher service's pair store, in cursor order, none twice.

The pairs come through the teacher client (``teacher/client.py``: ``take_pairs(n, after_cursor)``);
the cursor of the last pair taken is this source's position, saved in the orchestrator's
checkpoint, so a resumed run takes exactly the pairs the interrupted one had not. A step with no
ready pair trains without the channel (counted in ``replay/pairs``).

Ages: at each step the source notes the newest ready cursor, so a pair's age is the steps since
the first step at which it was ready (``replay/pair_age_mean``, ``replay/pair_age_max``). With
``orchestrator.replay.max_pair_age = k`` pairs ready for more than ``k`` steps are skipped (the
cursor moves past them; ``replay/pairs_stale``), so the trained pairs are at most ``k`` steps old
even when the service makes pairs faster than the trainer takes them. With ``order = "newest"``
each step takes the ``pairs_per_step`` newest ready pairs and skips the older ones it has not taken
(also ``replay/pairs_stale``). The notes are saved with the cursor.

Held-out pairs: with ``heldout_pairs = N`` the first N ready pairs are set aside before any is
trained on (their cursors are checkpointed; the cursor moves past them), and every
``heldout_every`` steps they are added to the batch as ``HeldOutPair``s, which the trainer scores
(``dpo_heldout/*``) without training on them: a fixed set, so its accuracy and margin over the run
measure what the policy learned, unlike the loss on each step's fresh pairs.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

from prime_composer.config.orchestrator import ReplaySourceConfig
from prime_composer.orchestrator.replay.packing import HeldOutPair
from prime_composer.teacher.client import Pair, TeacherClient
from prime_composer.transport.groups import ReplayGroup


class PairSource:
    """``BatchSource`` of the replay pairs."""

    name = ReplayGroup.name

    def __init__(
        self, cfg: ReplaySourceConfig, output_dir: Path, teacher: TeacherClient | None = None
    ) -> None:
        self.cfg = cfg
        self.teacher = teacher or TeacherClient(store_path(cfg, output_dir))
        self.cursor = 0
        self._taken = 0
        self._stale = 0
        self._ages: list[int] = []
        self._seen: list[tuple[int, int]] = []
        """``(step, newest ready cursor at that step)`` with increasing cursors, above ``cursor``."""
        self._heldout: list[Pair] = []
        self._heldout_cursors: list[int] = []
        """The held-out set's cursors (checkpointed; the pairs are read again after a resume)."""
        self._scored = 0

    def _ready_step(self, cursor: int, step: int) -> int:
        """The first noted step at which ``cursor`` was ready."""
        index = bisect.bisect_left([c for _, c in self._seen], cursor)
        return self._seen[index][0] if index < len(self._seen) else step

    def _fill_heldout(self) -> None:
        if len(self._heldout) < len(self._heldout_cursors):  # resumed: read the set again
            wanted = set(self._heldout_cursors)
            first = min(wanted)
            got = self.teacher.take_pairs(max(wanted) - first + 1, after_cursor=first - 1)
            self._heldout = [p for p in got if p.cursor in wanted]
        missing = self.cfg.heldout_pairs - len(self._heldout_cursors)
        if missing > 0:
            more = self.teacher.take_pairs(missing, after_cursor=self.cursor)
            self._heldout += more
            self._heldout_cursors += [p.cursor for p in more]
            if more:
                self.cursor = more[-1].cursor

    async def take(self, step: int) -> list[Any]:
        if self.cfg.heldout_pairs:
            self._fill_heldout()
        newest = self.teacher.newest_cursor()
        if newest > self.cursor and (not self._seen or newest > self._seen[-1][1]):
            self._seen.append((step, newest))
        self._stale = 0
        if self.cfg.max_pair_age is not None:
            stale = [c for s, c in self._seen if s < step - self.cfg.max_pair_age]
            if stale and stale[-1] > self.cursor:  # cursors are contiguous: skip 1..stale[-1]
                self._stale = stale[-1] - self.cursor
                self.cursor = stale[-1]
        if self.cfg.order == "newest" and newest - self.cfg.pairs_per_step > self.cursor:
            self._stale += newest - self.cfg.pairs_per_step - self.cursor
            self.cursor = newest - self.cfg.pairs_per_step
        pairs: list[Pair] = self.teacher.take_pairs(self.cfg.pairs_per_step, after_cursor=self.cursor)
        self._ages = [step - self._ready_step(p.cursor, step) for p in pairs]
        if pairs:
            self.cursor = pairs[-1].cursor
        self._seen = [(s, c) for s, c in self._seen if c > self.cursor]
        self._taken = len(pairs)
        scored: list[Any] = []
        if self._heldout and step % self.cfg.heldout_every == 0:
            scored = [HeldOutPair(p) for p in self._heldout]
        self._scored = len(scored)
        return list(pairs) + scored

    def metrics(self) -> dict[str, float]:
        ages = self._ages
        return {
            "replay/pairs": self._taken,
            "replay/cursor": self.cursor,
            "replay/pairs_stale": self._stale,
            "replay/pair_age_mean": sum(ages) / len(ages) if ages else 0.0,
            "replay/pair_age_max": max(ages, default=0),
            "replay/heldout_scored": self._scored,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "cursor": self.cursor,
            "seen": [list(e) for e in self._seen],
            "heldout": list(self._heldout_cursors),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor = int(state.get("cursor", 0))
        self._seen = [(int(s), int(c)) for s, c in state.get("seen", [])]
        self._heldout_cursors = [int(c) for c in state.get("heldout", [])]
        self._heldout = []


def store_path(cfg: ReplaySourceConfig, output_dir: Path) -> Path:
    """The teacher service's store: ``orchestrator.replay.store``, else the run's own."""
    return cfg.store or Path(output_dir) / "teacher" / "teacher.sqlite"

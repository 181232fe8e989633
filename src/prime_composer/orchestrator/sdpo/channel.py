"""SDPO's part in the orchestrator: each step's failed rollouts get hinted teacher contexts
(``hints.py``), which ``packing.py`` packs into the ``sdpo`` group."""

from __future__ import annotations

import time
from typing import Any

from prime_composer.config.sdpo import HintConfig
from prime_composer.orchestrator.channel import OrchestratorChannel
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.sdpo.hints import HintBuilder
from prime_composer.orchestrator.sdpo.packing import SDPOPacker
from prime_composer.orchestrator.sdpo.target import NAME


class SDPOChannel(OrchestratorChannel):
    """Hints on the step's samples (``take``), no items of its own; no checkpoint state."""

    name = NAME

    def __init__(self, cfg: HintConfig, hints: HintBuilder) -> None:
        self.cfg = cfg
        self.hints = hints
        self.packer = SDPOPacker()
        self._metrics: dict[str, float] = {}

    async def take(self, step: int, samples: list[Sample]) -> list[Any]:
        t0 = time.monotonic()
        stats = await self.hints.apply(samples)
        self._metrics = {**stats.metrics(self.cfg.sources), "time/hints_s": time.monotonic() - t0}
        return []

    def metrics(self) -> dict[str, float]:
        return self._metrics

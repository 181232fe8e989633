"""The entropy-bonus channel's orchestrator part: it marks failed rollouts, its packer turns
them into the group's token mask."""

from __future__ import annotations

from typing import Any

import torch

from entropy_bonus.group import EntropyBonusGroup
from entropy_bonus.spec import NAME, EntropyBonusConfig
from prime_composer.orchestrator.channel import OrchestratorChannel
from prime_composer.orchestrator.packing import Piece, Placement
from prime_composer.orchestrator.sample import Sample
from prime_composer.transport.batch import BatchGroup


class EntropyBonusPacker:
    name = NAME

    def begin(self, items: list[Any], num_micro_batches: int) -> None:
        pass

    def fit(self, sample: Sample, piece: Piece, seq_len: int) -> bool | None:
        return True if sample.channels.get(NAME) else None

    def build(
        self, placements: list[Placement], num_rows: int, seq_len: int, pad_token_id: int
    ) -> EntropyBonusGroup | None:
        marked = [p for p in placements if p.piece.extras.get(NAME)]
        if not marked:
            return None
        mask = torch.zeros((num_rows, seq_len), dtype=torch.bool)
        for p in marked:
            mask[p.row, p.start : p.start + len(p.piece.input_ids)] = torch.tensor(p.piece.loss_mask)
        return EntropyBonusGroup(token_mask=mask)

    def metrics(
        self, samples: list[Sample], pieces: list[Piece], groups: list[BatchGroup]
    ) -> dict[str, float]:
        return {"entropy_bonus/packed_samples": sum(NAME in p.extras for p in pieces)}


class EntropyBonusChannel(OrchestratorChannel):
    name = NAME

    def __init__(self, cfg: EntropyBonusConfig) -> None:
        self.cfg = cfg
        self.packer = EntropyBonusPacker()
        self._marked = 0

    async def take(self, step: int, samples: list[Sample]) -> list[Any]:
        self._marked = 0
        for s in samples:
            s.channels[NAME] = s.reward < self.cfg.max_reward
            self._marked += int(s.channels[NAME])
        return []

    def metrics(self) -> dict[str, float]:
        return {"entropy_bonus/marked": self._marked}

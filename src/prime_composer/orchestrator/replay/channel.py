"""The replay channel's part in the orchestrator, all through one ``teacher.client.TeacherClient``:
the run's rollouts go to the teacher service as traces (``trace_export.py``, with
``orchestrator.replay.send_traces``), its pairs come back into every batch (``source.py``, packed by
``packing.py``; with ``orchestrator.replay.enabled``), and its process rewards shape the advantages
(``shaping.py``; with ``orchestrator.advantage.process_reward_weight > 0``). The pair cursor is its
checkpoint state."""

from __future__ import annotations

from typing import Any

from prime_composer.client.http import read_api_key
from prime_composer.config.orchestrator import OrchestratorConfig
from prime_composer.orchestrator.channel import OrchestratorChannel
from prime_composer.orchestrator.replay.packing import ReplayPacker
from prime_composer.orchestrator.replay.shaping import ProcessRewards
from prime_composer.orchestrator.replay.source import PairSource, store_path
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.trace_export import samples_to_traces
from prime_composer.teacher.client import TeacherClient
from prime_composer.transport.groups import ReplayGroup


class ReplayChannel(OrchestratorChannel):
    name = ReplayGroup.name

    def __init__(self, config: OrchestratorConfig) -> None:
        self.config = config
        replay = config.replay
        self.teacher = TeacherClient(store_path(replay, config.output_dir))
        self.source = PairSource(replay, config.output_dir, self.teacher) if replay.enabled else None
        self.packer = ReplayPacker() if replay.enabled else None
        self.shaping: ProcessRewards | None = None

    @staticmethod
    def wanted(config: OrchestratorConfig) -> bool:
        """Whether the run uses any part of the channel."""
        replay = config.replay
        return (
            replay.enabled
            or (replay.send_traces and replay.teacher_url is not None)
            or config.advantage.process_reward_weight > 0
        )

    async def open(self) -> None:
        replay = self.config.replay
        if replay.send_traces and replay.teacher_url is not None:
            self.teacher.connect(
                replay.teacher_url,
                read_api_key(replay.teacher_secret_env, "orchestrator.replay.teacher_secret_env"),
                replay.retry,
            )
        if self.config.advantage.process_reward_weight > 0:
            self.shaping = ProcessRewards(self.teacher)
            self.process_rewards = self.shaping.lookup

    def observe(self, generated: list[Sample]) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if self.teacher.connected:  # the teacher service replays the run's own rollouts
            self.teacher.send(samples_to_traces(generated))
            metrics.update(self.teacher.metrics())
        if self.shaping is not None:
            metrics.update(self.shaping.metrics())
        return metrics

    async def take(self, step: int, samples: list[Sample]) -> list[Any]:
        return await self.source.take(step) if self.source is not None else []

    def metrics(self) -> dict[str, float]:
        return self.source.metrics() if self.source is not None else {}

    def state_dict(self) -> dict[str, Any]:
        return self.source.state_dict() if self.source is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.source is not None:
            self.source.load_state_dict(state)

    async def aclose(self) -> None:
        await self.teacher.aclose()

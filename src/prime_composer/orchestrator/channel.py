"""A channel's part in the orchestrator (``config/channels.py`` builds one per enabled channel).

Per step the loop (``loop.py``) calls, on every channel, in registration order:

1. ``observe(generated)`` with every rollout the step generated (the replay channel posts them to
   the teacher service as traces); returns metrics;
2. ``take(step, samples)`` with the samples to be trained on: the channel may annotate them
   (``Sample.channels[<name>]``: SDPO's hinted teacher context) and returns items of its own for
   its packer (replay's pairs);
3. its ``packer`` (``packing.GroupPacker``, or None) builds its batch group from both;
4. ``metrics()`` after ``take``.

``process_rewards``, when set, gives each finished rollout of a group a process reward to shape its
advantage (``stream.py``). ``state_dict`` is the channel's entry in the orchestrator checkpoint
(an empty dict: nothing to save); ``open``/``aclose`` bracket the run inside its event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from prime_composer.config.channels import Switched, channels
from prime_composer.config.orchestrator import OrchestratorConfig
from prime_composer.orchestrator.packing import GroupPacker
from prime_composer.orchestrator.sample import ProcessReward, Sample

ProcessRewardFn = Callable[[list[Sample]], Sequence[float | ProcessReward | None]]


@dataclass(frozen=True)
class ChannelContext:
    """What the orchestrator gives a channel's builder beside its config."""

    tokenizer: Any
    """The policy's tokenizer (Hugging Face)."""


class OrchestratorChannel:
    """Base of a channel's orchestrator part: every hook does nothing until overridden."""

    name: str
    """The channel's name (its batch group, its checkpoint entry)."""
    packer: GroupPacker | None = None
    process_rewards: ProcessRewardFn | None = None

    async def open(self) -> None:
        """Start (inside the run's event loop): clients, store connections."""

    def observe(self, generated: list[Sample]) -> dict[str, float]:
        """See every rollout generated this step (failed ones included); returns metrics."""
        return {}

    async def take(self, step: int, samples: list[Sample]) -> list[Any]:
        """Annotate this step's ``samples`` and return the items for ``packer`` (may be none)."""
        return []

    def metrics(self) -> dict[str, float]:
        """The step's metrics, after ``take``."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict``'s output (``{}`` when the checkpoint has no entry)."""

    async def aclose(self) -> None:
        """Release what ``open`` took."""


def build_channels(config: OrchestratorConfig, ctx: ChannelContext) -> list[OrchestratorChannel]:
    """The orchestrator parts of the channels this config enables, in registration order."""
    built: list[OrchestratorChannel] = []
    for spec in channels():
        if spec.orchestrator is not None and (part := spec.orchestrator(config, ctx)) is not None:
            if not isinstance(part, OrchestratorChannel):
                raise TypeError(
                    f"channel {spec.name!r}: its orchestrator builder returned {part!r}, not an OrchestratorChannel"
                )
            built.append(part)
    for spec in channels():
        section = config.section(spec.name) if spec.orchestrator_config is not None else None
        if (
            section is not None
            and cast(Switched, section).enabled
            and spec.name not in {c.name for c in built}
        ):
            raise ValueError(
                f"orchestrator.{spec.name}.enabled = true but the channel built no orchestrator part"
            )
    return built

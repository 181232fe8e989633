"""The entropy-bonus channel's spec and config sections (torch-free)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from prime_composer.config.base import BaseConfig
from prime_composer.config.channels import ChannelSpec, Column, Pairing

if TYPE_CHECKING:
    from prime_composer.config.orchestrator import OrchestratorConfig
    from prime_composer.orchestrator.channel import ChannelContext, OrchestratorChannel

NAME = "entropy_bonus"


class EntropyBonusLossConfig(BaseConfig):
    """``trainer.loss.entropy_bonus``."""

    weight: float = Field(default=0.0, ge=0.0)
    """Weight of ``-mean entropy`` over the marked tokens; 0 = off."""


class EntropyBonusConfig(BaseConfig):
    """``orchestrator.entropy_bonus``."""

    enabled: bool = False
    """Mark the tokens of failed rollouts for the bonus."""

    max_reward: float = 0.5
    """Rollouts with a reward below this get the bonus."""


def build_orchestrator(config: OrchestratorConfig, ctx: ChannelContext) -> OrchestratorChannel | None:
    section = config.section(NAME)
    assert isinstance(section, EntropyBonusConfig)
    if not section.enabled:
        return None
    from entropy_bonus.orchestrator import EntropyBonusChannel

    return EntropyBonusChannel(section)


SPEC = ChannelSpec(
    name=NAME,
    loss_config=EntropyBonusLossConfig,
    term_module="entropy_bonus.term",
    orchestrator_config=EntropyBonusConfig,
    orchestrator=build_orchestrator,
    pairing=Pairing(
        items="the marked tokens", nothing="no token would ever get the bonus", example_weight=0.01
    ),
    columns=(Column("bonus", "trainer", ("loss/entropy_bonus",)),),
    panels=(Column("entropy bonus", "trainer", ("loss/entropy_bonus",)),),
)

"""The RL channel: the clipped policy gradient on the rollouts' own tokens. Its tensors are the
micro-batch's core ones (advantages, inference logprobs), so it has no batch group and no
orchestrator part; its term is ``trainer/losses/rl_term.py``."""

from __future__ import annotations

from prime_composer.config.channels import ChannelSpec, Column, register_channel
from prime_composer.config.loss import RLLossConfig

SPEC = register_channel(
    ChannelSpec(
        name="rl",
        loss_config=RLLossConfig,
        term_module="prime_composer.trainer.losses.rl_term",
        columns=(Column("entropy", "trainer", ("entropy",)),),
        panels=(Column("entropy", "trainer", ("entropy",)),),
    )
)

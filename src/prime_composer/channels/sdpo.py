"""The SDPO channel: hints from the orchestrator (``orchestrator/sdpo/``), the ``sdpo`` batch group
(``transport/groups.py``), the distillation term (``trainer/losses/sdpo_term.py``). Its sections
are ``orchestrator.sdpo`` (``config/sdpo.py``) and ``trainer.loss.sdpo`` (``config/loss.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prime_composer.config.channels import BuildContext, ChannelSpec, Column, Pairing, register_channel
from prime_composer.config.loss import SDPOLossConfig
from prime_composer.config.sdpo import HintConfig

if TYPE_CHECKING:
    from prime_composer.config.orchestrator import OrchestratorConfig
    from prime_composer.orchestrator.channel import OrchestratorChannel


def build_orchestrator(config: OrchestratorConfig, ctx: BuildContext) -> OrchestratorChannel | None:
    if not config.sdpo.enabled:
        return None
    from prime_composer.orchestrator.sdpo.channel import SDPOChannel
    from prime_composer.orchestrator.sdpo.hints import HintBuilder

    hints = HintBuilder(
        config.sdpo,
        ctx.tokenizer,
        config.seq_len,
        chat_template_kwargs=config.sampling.extra_body.get("chat_template_kwargs"),
    )
    return SDPOChannel(config.sdpo, hints)


SPEC = register_channel(
    ChannelSpec(
        name="sdpo",
        loss_config=SDPOLossConfig,
        term_module="prime_composer.trainer.losses.sdpo_term",
        orchestrator_config=HintConfig,
        orchestrator=build_orchestrator,
        pairing=Pairing(items="the hints", nothing="no sample would ever carry a hint", example_weight=0.1),
        columns=(
            Column("sdpo", "trainer", ("loss/sdpo",)),
            Column("hinted", "orchestrator", ("sdpo/hinted_fraction",)),
        ),
        panels=(
            Column("SDPO loss", "trainer", ("loss/sdpo",)),
            Column("hinted fraction", "orchestrator", ("sdpo/hinted_fraction",)),
        ),
    )
)

"""The replay channel: the teacher service's step-level DPO pairs. The orchestrator sends it the
run's rollouts as traces and mixes its pairs into every batch (``orchestrator/replay/``), the
``replay`` batch group carries them (``transport/groups.py``), the DPO term trains on them
(``trainer/losses/replay_term.py``). Its sections are ``orchestrator.replay``
(``config/orchestrator.py``) and ``trainer.loss.replay`` (``config/dpo.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prime_composer.config.channels import BuildContext, ChannelSpec, Column, Pairing, register_channel
from prime_composer.config.cli import origin_of
from prime_composer.config.dpo import DPOLossConfig
from prime_composer.config.errors import ConfigError
from prime_composer.config.orchestrator import ReplaySourceConfig
from prime_composer.config.resolve import client_host

if TYPE_CHECKING:
    from prime_composer.config.orchestrator import OrchestratorConfig
    from prime_composer.config.rl import RLConfig
    from prime_composer.orchestrator.channel import OrchestratorChannel


def build_orchestrator(config: OrchestratorConfig, ctx: BuildContext) -> OrchestratorChannel | None:
    from prime_composer.orchestrator.replay.channel import ReplayChannel

    return ReplayChannel(config) if ReplayChannel.wanted(config) else None


def resolve(config: RLConfig, origins: dict[str, str]) -> None:
    """Process rewards need the teacher service's store; the orchestrator learns where the service
    listens (it posts its rollouts there as traces)."""
    shaping = config.orchestrator.advantage.process_reward_weight
    if shaping > 0 and config.teacher is None and config.orchestrator.replay.store is None:
        raise ConfigError(
            f"{origin_of('orchestrator.advantage.process_reward_weight', origins)}: "
            f"orchestrator.advantage.process_reward_weight = {shaping} needs the teacher service's process "
            "rewards, but the run has no [teacher] section (and no orchestrator.replay.store): add one, or "
            "set the weight to 0"
        )
    teacher = config.teacher
    if teacher is not None:
        for i, endpoint in enumerate(teacher.pool):
            if endpoint.local is not None and endpoint.base_url is not None:
                raise ConfigError(
                    f"{origin_of('teacher.pool', origins)}: teacher.pool[{i}] ({endpoint.id!r}) sets both "
                    "base_url and local; rl serves a local teacher on a port of its own and fills in "
                    "base_url: remove one of them"
                )
        config.orchestrator.replay.teacher_url = f"http://{client_host(teacher.host)}:{teacher.port}"
        config.orchestrator.replay.teacher_secret_env = teacher.secret_env


def summary(run: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The channel's totals (nothing when the run had none)."""
    lines = []
    pairs = [r["replay/pairs"] for r in run.get("orchestrator", []) if r.get("replay/pairs") is not None]
    if pairs:
        lines.append(
            f"replay: {sum(pairs):.0f} pairs in {len(pairs)} steps ({sum(pairs) / len(pairs):.1f} per step, "
            f"{sum(1 for p in pairs if p > 0)} steps with pairs)"
        )
    held = [r for r in run.get("trainer", []) if r.get("dpo_heldout/accuracy") is not None]
    if held:
        first, last = held[0], held[-1]
        lines.append(
            f"replay held-out pairs: DPO accuracy {first['dpo_heldout/accuracy']:.2f} -> "
            f"{last['dpo_heldout/accuracy']:.2f}, margin {first.get('dpo_heldout/margin', 0.0):.3f} -> "
            f"{last.get('dpo_heldout/margin', 0.0):.3f} ({len(held)} scorings)"
        )
    teacher = run.get("teacher", [])
    if teacher:
        last = teacher[-1]
        lines.append(
            f"teachers: ${last.get('teacher/spent_usd', 0.0):.4f} spent on {last.get('teacher/calls_paid', 0):.0f} "
            f"calls, {last.get('teacher/votes', 0):.0f} votes, agreement with the policy "
            f"{last.get('teacher/agreement_rate', 0.0):.2f}, {last.get('teacher/steps_pair', 0):.0f} steps "
            f"became pairs, {last.get('teacher/steps_confirmed', 0):.0f} confirmed"
        )
        bounded = {
            k: last.get(f"teacher/calls_{k}", 0)
            for k in ("timeout", "step_deadline", "too_large", "too_many_tokens", "budget", "orphaned")
        }
        if any(bounded.values()):
            lines.append("teacher calls: " + ", ".join(f"{v:.0f} {k}" for k, v in bounded.items()))
        if last.get("teacher/gate_labels"):
            lines.append(
                f"teacher gate: ECE {last.get('teacher/gate_ece', 0.0):.3f}, Brier "
                f"{last.get('teacher/gate_brier', 0.0):.3f} over {last['teacher/gate_labels']:.0f} labeled steps"
            )
    return lines


SPEC = register_channel(
    ChannelSpec(
        name="replay",
        loss_config=DPOLossConfig,
        term_module="prime_composer.trainer.losses.replay_term",
        orchestrator_config=ReplaySourceConfig,
        orchestrator=build_orchestrator,
        pairing=Pairing(items="the pairs", nothing="no batch would ever carry a pair", example_weight=0.05),
        resolve=resolve,
        columns=(
            Column("pairs", "orchestrator", ("replay/pairs",)),  # pairs in this step's batch,
            Column("spend $", "teacher", ("teacher/spent_usd",)),  # teacher dollars so far,
            Column("agree", "teacher", ("teacher/agreement_rate",)),  # teacher votes for the policy's action
            Column("pair age", "orchestrator", ("replay/pair_age_max",)),  # steps the oldest pair was ready
            Column("held acc", "trainer", ("dpo_heldout/accuracy",)),  # DPO accuracy on the held-out pairs
        ),
        panels=(
            Column("replay pairs per step", "orchestrator", ("replay/pairs",)),
            Column("replay DPO loss", "trainer", ("loss/replay",)),
            Column("replay pair age (steps)", "orchestrator", ("replay/pair_age_mean",)),
            Column("replay DPO accuracy", "trainer", ("dpo/accuracy",)),
            Column("replay DPO margin", "trainer", ("dpo/margin",)),
            Column("teacher calls cut off", "teacher", ("teacher/calls_timeout",)),
            Column("replay held-out DPO accuracy", "trainer", ("dpo_heldout/accuracy",)),
            Column("replay held-out DPO margin", "trainer", ("dpo_heldout/margin",)),
            Column("replay reference drift (per token)", "trainer", ("dpo/ref_drift",)),
            Column("teacher gate calibration (ECE)", "teacher", ("teacher/gate_ece",)),
        ),
        summary=summary,
    )
)

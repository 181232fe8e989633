"""Loss terms as one mechanism: ``total = sum_k weight_k * L_k`` over the enabled terms.

Every term of the objective (``rl``, ``sdpo``, later ``dpo``) is a ``LossTerm`` subclass in its own
file of this package, registered under the name of its config section (``trainer.loss.<name>``,
which has a ``weight``). The trainer step (``trainer/step.py``) knows none of them; per step it

1. calls ``begin_step(micro_batches)`` on every term: the term computes its global normalizer
   once (all micro-batches, all ranks: a collective) and whatever else is per step;
2. per micro-batch, calls ``prepare(index, mb)``: no-grad forwards the term needs (the SDPO
   teacher, the KL reference), run *before* the student's forward so their activations are gone
   when the student's are alive;
3. runs one student forward, giving each term the logits it asked for (``logits_mask``) and the
   token logprobs and entropies every term may read (``trainer/forward.py``);
4. adds ``weight * loss(index, mb, out)`` over the terms and runs backward; each term's
   unweighted loss is logged as ``loss/<name>``, its ``[sum, count]`` metrics reduced exactly;
5. after the optimizer step, ``TermContext.after_optimizer_step`` moves the EMA copy.

A term whose weight is 0 is never constructed (``build_terms``), so it costs nothing: no copy of
the policy, no teacher forward, no collective. A term is the trainer side of a channel
(``config/channels.py``): a subclass with ``@register_term("<name>")`` in the module the channel's
``ChannelSpec.term_module`` names (the built-in ones are the ``*_term`` modules here), which
``build_terms`` imports; its config section is the channel's ``trainer.loss.<name>``. The step
does not change (``docs/architecture.md`` walks through an example).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

from torch import Tensor, nn

from prime_composer.config.channels import channel, channels
from prime_composer.config.loss import LossConfig
from prime_composer.trainer.forward import ForwardOutput
from prime_composer.trainer.policy_copy import CopyKind, PolicyCopy
from prime_composer.transport.batch import MicroBatch


class TermContext:
    """What terms share: the policy, how to make sharded copies of it, and the copies made.

    ``copy(kind)`` builds at most one ``PolicyCopy`` per kind and hands the same one to every term
    that asks (the SDPO teacher and the KL reference share one frozen copy); their weights are
    checkpointed under ``policy_copy_<kind>`` (``checkpoint_states``).
    """

    def __init__(
        self,
        policy: nn.Module,
        make_copy: Callable[[], nn.Module] | None = None,
        world_size: int = 1,
    ) -> None:
        """``make_copy`` builds an empty module sharded like ``policy`` (FSDP2); None deep-copies."""
        self.policy = policy
        self.make_copy = make_copy
        self.world_size = world_size
        self.copies: dict[str, PolicyCopy] = {}

    def copy(self, kind: CopyKind, ema_rate: float = 0.99) -> PolicyCopy:
        existing = self.copies.get(kind)
        if existing is not None:
            if kind == "ema" and existing.rate != ema_rate:
                raise ValueError(
                    f"two loss terms ask for EMA copies with rates {existing.rate} and {ema_rate}"
                )
            return existing
        made = PolicyCopy(self.policy, kind, ema_rate=ema_rate, make_copy=self.make_copy)
        self.copies[kind] = made
        return made

    def after_optimizer_step(self) -> None:
        for policy_copy in self.copies.values():
            policy_copy.update(self.policy)

    def checkpoint_states(self) -> dict[str, Any]:
        """The copies with weights of their own (``ema``, ``frozen``; ``live`` is the policy)."""
        return {f"policy_copy_{kind}": c for kind, c in self.copies.items() if kind != "live"}


class LossTerm:
    """One term of the objective (see the module docstring for when each method runs)."""

    name: ClassVar[str]
    """The term's config section (``trainer.loss.<name>``) and metric prefix (``loss/<name>``)."""

    def __init__(self, weight: float) -> None:
        self.weight = weight

    def logits_mask(self, mb: MicroBatch) -> Tensor | None:
        """``[R, T]`` bool: tokens whose whole predicting distribution this term needs from the
        student forward (``ForwardOutput.logits[self.name]``); None = only logprobs."""
        return None

    def begin_step(self, micro_batches: Sequence[MicroBatch]) -> None:
        """Per-step setup before the first micro-batch, e.g. the global normalizer. Collective:
        every rank calls it with its own micro-batches."""

    def prepare(self, index: int, mb: MicroBatch) -> None:
        """No-grad work for micro-batch ``index`` before the student forward (teacher, reference)."""

    def loss(self, index: int, mb: MicroBatch, out: ForwardOutput) -> tuple[Tensor, dict[str, Tensor]]:
        """Micro-batch ``index``'s share of this term, unweighted: ``(sum over its units / the step's
        global count, {metric: [sum, count]})``; the shares of all micro-batches and ranks add up to
        the term's value for the step."""
        raise NotImplementedError(f"{type(self).__name__} must implement loss()")

    def step_metrics(self) -> dict[str, float]:
        """Per-step scalars to log after the step (e.g. the global count behind the normalizer)."""
        return {}


T = TypeVar("T", bound=type[LossTerm])
TermFactory = Callable[[Any, TermContext], LossTerm]

LOSS_TERMS: dict[str, TermFactory] = {}
"""Term builders by config-section name: ``(section config, context) -> LossTerm``."""


def register_term(name: str) -> Callable[[T], T]:
    """Class decorator: ``cls.build(cfg, ctx)`` makes the term for ``trainer.loss.<name>``."""

    def decorate(cls: T) -> T:
        if name in LOSS_TERMS:
            raise TypeError(f"loss term {name!r} is registered twice")
        if channel(name) is None:
            raise TypeError(f"loss term {name!r} belongs to no registered channel (config/channels.py)")
        cls.name = name
        LOSS_TERMS[name] = cls.build  # type: ignore[attr-defined]
        return cls

    return decorate


def load_term_modules() -> None:
    """Import every registered channel's term module, so their terms are registered."""
    for spec in channels():
        importlib.import_module(spec.term_module)


def build_terms(cfg: LossConfig, ctx: TermContext) -> list[LossTerm]:
    """The enabled terms (weight > 0), in the channels' registration order."""
    load_term_modules()
    terms = []
    for name, section in cfg.sections():
        if section.weight <= 0:
            continue
        if name not in LOSS_TERMS:
            raise ValueError(f"trainer.loss.{name}.weight > 0 but no loss term is registered for {name!r}")
        terms.append(LOSS_TERMS[name](section, ctx))
    return terms

"""What a channel is, and the registry of channels.

A *channel* is one source of training signal that crosses the processes: RL, SDPO hint
distillation, replay pairs, the next one. Its ``ChannelSpec`` names every piece it brings, once:

====================  ============================================================================
config                ``trainer.loss.<name>`` (``loss_config``, has ``weight``); optionally
                      ``orchestrator.<name>`` (``orchestrator_config``, has ``enabled``)
cross-process checks  both halves on together (``pairing``) plus ``resolve`` (wiring, checks)
orchestrator          ``orchestrator``: builds its ``orchestrator.channel.OrchestratorChannel``
                      (annotates samples, brings items, its group packer, its checkpoint state)
batch group           the group of the same name (``transport/batch.py``), packed by the packer
trainer               ``term_module``: importing it registers the loss term ``<name>``
                      (``trainer/losses/base.py``) and its batch group
metrics               ``columns`` of the progress line, ``panels`` and ``summary`` of the report
====================  ============================================================================

This module is config: torch-free, importing nothing above ``config/``. It sits above
``config.rl`` (a builder takes an ``OrchestratorConfig``, a resolver an ``RLConfig``, both checked
by mypy); the registry itself and the part the config models need (``ChannelEntry``: name and
section classes) are one layer down, in ``config/sections.py``, so no config model imports this
module and no import, typing-only included, runs in a loop. The orchestrator and trainer sides are
reached through callables that import them when called, and through ``term_module``, a module path
the trainer imports. The loop, the resolver, the progress line and the report iterate
``channels()`` and name no channel.

Config sections of plugin channels: the built-in channels' sections are ordinary fields of
``LossConfig`` and ``OrchestratorConfig`` (they show in ``--help``). Both derive from
``ChannelSections`` (``config/sections.py``), which also accepts a section for every registered
plugin channel, validated by the channel's own config class, kept beside the fields, written back
by ``model_dump`` (so a resolved config round-trips to each process) and read with
``section(name)``; the CLI's dotted keys find it too (``plugin_section``). Any other unknown key
stays an error.

Registration: the built-in channels (``prime_composer/channels/rl.py``, ``sdpo.py``,
``replay.py``) are imported by name on first use, like entry points; a plugin package registers its own with ``register_channel`` when
imported, or is imported by its entry point in the ``prime_composer.channels`` group (so that
every process of a run finds it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from prime_composer.config.orchestrator import OrchestratorConfig
from prime_composer.config.rl import RLConfig
from prime_composer.config.sections import (
    BUILTIN_MODULES,
    CHANNELS,
    ENTRY_POINT_GROUP,
    ChannelEntry,
    ChannelSections,
    Switched,
    Weighted,
    plugin_section,
    registered,
)

__all__ = [
    "BUILTIN_MODULES",
    "ENTRY_POINT_GROUP",
    "BuildContext",
    "ChannelSections",
    "ChannelSpec",
    "Column",
    "OrchestratorPart",
    "Pairing",
    "Switched",
    "Weighted",
    "channel",
    "channels",
    "plugin_section",
    "register_channel",
    "unregister_channel",
]


class BuildContext(Protocol):
    """What the orchestrator gives a channel's builder beside its config
    (``orchestrator.channel.ChannelContext``)."""

    @property
    def tokenizer(self) -> Any:
        """The policy's tokenizer (Hugging Face)."""
        ...


class OrchestratorPart(Protocol):
    """A channel's part in the orchestrator: an ``orchestrator.channel.OrchestratorChannel`` (the
    orchestrator checks that it is one; config names only what it needs)."""

    name: str


@dataclass(frozen=True)
class Column:
    """A metric shown when present: ``label``, the ``process`` whose metrics file has it, and the
    keys tried in order (the first present wins)."""

    label: str
    process: str
    keys: tuple[str, ...]


@dataclass(frozen=True)
class Pairing:
    """The two halves of a channel must be on together: ``orchestrator.<name>.enabled`` and
    ``trainer.loss.<name>.weight > 0``. One without the other would silently do nothing."""

    items: str
    """What the orchestrator half makes, for the error message (``"the hints"``)."""
    nothing: str
    """What goes missing without it (``"no sample would ever carry a hint"``)."""
    example_weight: float
    """A weight to suggest in the error message."""


@dataclass(frozen=True)
class ChannelSpec(ChannelEntry):
    """Everything one channel brings (see the module docstring): its name, config sections and
    term module (``ChannelEntry``), and what the processes do with them."""

    orchestrator: Callable[[OrchestratorConfig, BuildContext], OrchestratorPart | None] | None = None
    """Builds the channel's orchestrator part for a run (None when it is off in this config).
    Raises ValueError naming the key to fix on bad settings."""
    pairing: Pairing | None = None
    """Set when ``orchestrator.<name>.enabled`` and ``trainer.loss.<name>.weight`` go together."""
    resolve: Callable[[RLConfig, dict[str, str]], None] | None = None
    """More checks and wiring across processes when ``rl`` resolves a config (raise ConfigError)."""
    columns: tuple[Column, ...] = ()
    """Columns of the launcher's progress line."""
    panels: tuple[Column, ...] = ()
    """Panels of ``report.png``."""
    summary: Callable[[dict[str, list[dict[str, Any]]]], list[str]] | None = None
    """Lines of the end-of-run text summary, from every process's metrics records."""


def register_channel(spec: ChannelSpec) -> ChannelSpec:
    """Add a channel; its name must be new. Returns ``spec``."""
    CHANNELS.load_all()  # the built-ins first, whoever registers first
    CHANNELS.register(spec.name, spec)
    return spec


def unregister_channel(name: str) -> None:
    """Remove a channel (tests that register a toy one clean up with it)."""
    CHANNELS.unregister(name)


def channels() -> list[ChannelSpec]:
    """Every registered channel, built-ins first, in registration order."""
    return [_spec(entry) for entry in registered()]


def channel(name: str) -> ChannelSpec | None:
    CHANNELS.load_all()
    entry = CHANNELS.get(name)
    return None if entry is None else _spec(entry)


def _spec(entry: ChannelEntry) -> ChannelSpec:
    if not isinstance(entry, ChannelSpec):  # only register_channel adds entries
        raise TypeError(f"channel {entry.name!r} is registered without its ChannelSpec")
    return entry

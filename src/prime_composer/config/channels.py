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

This module is config: torch-free, importing nothing above ``config/``. The orchestrator and
trainer sides are reached through callables that import them when called, and through
``term_module``, a module path the trainer imports. The loop, the resolver, the progress line and
the report iterate ``channels()`` and name no channel.

Config sections of plugin channels: the built-in channels' sections are ordinary fields of
``LossConfig`` and ``OrchestratorConfig`` (they show in ``--help``). Both derive from
``ChannelSections``, which also accepts a section for every registered plugin channel, validated by
the channel's own config class, kept beside the fields, written back by ``model_dump`` (so a
resolved config round-trips to each process) and read with ``section(name)``; the CLI's dotted
keys find it too (``plugin_section``). Any other unknown key stays an error.

Registration: the built-in channels (``prime_composer/channels/rl.py``, ``sdpo.py``,
``replay.py``) are imported by name on first use, like entry points; a plugin package registers its own with ``register_channel`` when
imported, or is imported by its entry point in the ``prime_composer.channels`` group (so that
every process of a run finds it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, cast

from pydantic import (
    BaseModel,
    PrivateAttr,
    SerializationInfo,
    ValidationError,
    model_serializer,
    model_validator,
)
from pydantic.functional_serializers import SerializerFunctionWrapHandler
from pydantic.functional_validators import ModelWrapValidatorHandler

from prime_composer.config.base import BaseConfig
from prime_composer.registry import Registry

if TYPE_CHECKING:
    from prime_composer.config.orchestrator import OrchestratorConfig
    from prime_composer.config.rl import RLConfig

BUILTIN_MODULES = (
    "prime_composer.channels.rl",
    "prime_composer.channels.sdpo",
    "prime_composer.channels.replay",
)
ENTRY_POINT_GROUP = "prime_composer.channels"


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
class ChannelSpec:
    """Everything one channel brings (see the module docstring)."""

    name: str
    """The config sections ``trainer.loss.<name>`` / ``orchestrator.<name>``, the loss term and its
    metric ``loss/<name>``, the batch group, the orchestrator checkpoint entry."""
    loss_config: type[BaseConfig]
    """The class of ``trainer.loss.<name>``; it has a ``weight`` (0 = off: the term is never built)."""
    term_module: str
    """Module whose import registers the loss term ``<name>`` (``@register_term``) and its group."""
    orchestrator_config: type[BaseConfig] | None = None
    """The class of ``orchestrator.<name>`` (with an ``enabled`` field); None: no orchestrator half."""
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

    def __post_init__(self) -> None:
        if "weight" not in self.loss_config.model_fields:
            raise TypeError(f"channel {self.name!r}: {self.loss_config.__name__} has no weight field")
        if self.orchestrator_config is not None and "enabled" not in self.orchestrator_config.model_fields:
            raise TypeError(
                f"channel {self.name!r}: {self.orchestrator_config.__name__} has no enabled field"
            )


_CHANNELS: Registry[ChannelSpec] = Registry(
    "channel",
    {module.rsplit(".", 1)[1]: module for module in BUILTIN_MODULES},
    entry_point_group=ENTRY_POINT_GROUP,
)


def register_channel(spec: ChannelSpec) -> ChannelSpec:
    """Add a channel; its name must be new. Returns ``spec``."""
    _CHANNELS.load_all()  # the built-ins first, whoever registers first
    return _CHANNELS.register(spec.name, spec)


def unregister_channel(name: str) -> None:
    """Remove a channel (tests that register a toy one clean up with it)."""
    _CHANNELS.unregister(name)


def channels() -> list[ChannelSpec]:
    """Every registered channel, built-ins first, in registration order."""
    _CHANNELS.load_all()
    return list(_CHANNELS.values())


def channel(name: str) -> ChannelSpec | None:
    _CHANNELS.load_all()
    return _CHANNELS.get(name)


# ------------------------------------------------------------------------ plugin sections


class Weighted(Protocol):
    """A ``trainer.loss.<name>`` section."""

    weight: float


class Switched(Protocol):
    """An ``orchestrator.<name>`` section."""

    enabled: bool


def _plugin_configs(kind: Literal["loss", "orchestrator"], builtin: set[str]) -> dict[str, type[BaseConfig]]:
    found: dict[str, type[BaseConfig]] = {}
    for spec in channels():
        config = spec.loss_config if kind == "loss" else spec.orchestrator_config
        if config is not None and spec.name not in builtin:
            found[spec.name] = config
    return found


def plugin_section(model: type[BaseModel], name: str) -> type[BaseConfig] | None:
    """The config class of section ``name`` of ``model`` when a plugin channel brings it (for the
    CLI's dotted keys, ``config/cli.py``); None otherwise."""
    if not (isinstance(model, type) and issubclass(model, ChannelSections)) or name in model.model_fields:
        return None
    return _plugin_configs(model.channel_kind, set(model.model_fields)).get(name)


class ChannelSections(BaseConfig):
    """A config model that also holds the sections of registered plugin channels."""

    channel_kind: ClassVar[Literal["loss", "orchestrator"]]
    _plugins: dict[str, BaseConfig] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _plugin_sections(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        plugins: dict[str, BaseConfig] = {}
        if isinstance(data, dict) and any(key not in cls.model_fields for key in data):
            known = _plugin_configs(cls.channel_kind, set(cls.model_fields))
            data = dict(data)
            for key in [k for k in data if k in known]:
                value = data.pop(key)
                try:
                    plugins[key] = (
                        value if isinstance(value, known[key]) else known[key].model_validate(value)
                    )
                except ValidationError as e:
                    problems = "; ".join(
                        f"{'.'.join(str(p) for p in (key, *err['loc']))}: {err['msg']}" for err in e.errors()
                    )
                    raise ValueError(problems) from None
        model = handler(data)
        if plugins:
            model._plugins = {**model._plugins, **plugins}
        return model

    @model_serializer(mode="wrap")
    def _dump_plugins(
        self, handler: SerializerFunctionWrapHandler, info: SerializationInfo
    ) -> dict[str, Any]:
        out = cast(dict[str, Any], handler(self))
        for name, section in self._plugins.items():
            out[name] = section.model_dump(mode=info.mode, exclude_unset=bool(info.exclude_unset))
        return out

    def section(self, name: str) -> BaseConfig:
        """The section ``name``: a field, a plugin section given in the config, or the registered
        plugin channel's defaults."""
        if name in type(self).model_fields:
            return cast(BaseConfig, getattr(self, name))
        if name in self._plugins:
            return self._plugins[name]
        known = _plugin_configs(self.channel_kind, set(type(self).model_fields))
        if name not in known:
            raise KeyError(f"no channel {name!r} has a section in this config")
        return known[name]()

"""The config half of the channel registry: the one registry of channels, and the sections a
channel brings, below every config model that holds a channel's section.

``LossConfig`` and ``OrchestratorConfig`` derive from ``ChannelSections``, which accepts a section
for every registered plugin channel beside their own fields. It needs only each channel's name and
section classes (``ChannelEntry``); ``config.channels.ChannelSpec``, whose builders take an
``OrchestratorConfig`` or an ``RLConfig``, extends ``ChannelEntry`` one layer up, so no config model
imports the module that names it. Entries are added only through
``config.channels.register_channel``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, cast

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

BUILTIN_MODULES = (
    "prime_composer.channels.rl",
    "prime_composer.channels.sdpo",
    "prime_composer.channels.replay",
)
ENTRY_POINT_GROUP = "prime_composer.channels"


@dataclass(frozen=True)
class ChannelEntry:
    """What the config models need of a channel: its name and the classes of its sections."""

    name: str
    """The config sections ``trainer.loss.<name>`` / ``orchestrator.<name>``, the loss term and its
    metric ``loss/<name>``, the batch group, the orchestrator checkpoint entry."""
    loss_config: type[BaseConfig]
    """The class of ``trainer.loss.<name>``; it has a ``weight`` (0 = off: the term is never built)."""
    term_module: str
    """Module whose import registers the loss term ``<name>`` (``@register_term``) and its group."""
    orchestrator_config: type[BaseConfig] | None = None
    """The class of ``orchestrator.<name>`` (with an ``enabled`` field); None: no orchestrator half."""

    def __post_init__(self) -> None:
        if "weight" not in self.loss_config.model_fields:
            raise TypeError(f"channel {self.name!r}: {self.loss_config.__name__} has no weight field")
        if self.orchestrator_config is not None and "enabled" not in self.orchestrator_config.model_fields:
            raise TypeError(
                f"channel {self.name!r}: {self.orchestrator_config.__name__} has no enabled field"
            )


CHANNELS: Registry[ChannelEntry] = Registry(
    "channel",
    {module.rsplit(".", 1)[1]: module for module in BUILTIN_MODULES},
    entry_point_group=ENTRY_POINT_GROUP,
)
"""Every channel by name (``config.channels.ChannelSpec``s); the built-ins and the entry points
are imported on first use."""


def registered() -> list[ChannelEntry]:
    """Every registered channel, built-ins first, in registration order."""
    CHANNELS.load_all()
    return list(CHANNELS.values())


# ------------------------------------------------------------------------ plugin sections


class Weighted(Protocol):
    """A ``trainer.loss.<name>`` section."""

    weight: float


class Switched(Protocol):
    """An ``orchestrator.<name>`` section."""

    enabled: bool


def _plugin_configs(kind: Literal["loss", "orchestrator"], builtin: set[str]) -> dict[str, type[BaseConfig]]:
    found: dict[str, type[BaseConfig]] = {}
    for spec in registered():
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

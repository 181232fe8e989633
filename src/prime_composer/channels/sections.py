"""Config sections of plugin channels: ``trainer.loss.<name>`` and ``orchestrator.<name>`` for a
registered channel that ``config/loss.py`` and ``config/orchestrator.py`` do not list.

The built-in channels' sections are ordinary fields (they show in ``--help``). A model deriving
from ``ChannelSections`` also accepts a section for every registered plugin channel, validated by
the channel's own config class, kept beside the fields, written back by ``model_dump`` (so a
resolved config round-trips to each process) and read with ``section(name)``; any other unknown
key stays an error. No torch import.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Protocol, cast

from pydantic import PrivateAttr, SerializationInfo, ValidationError, model_serializer, model_validator
from pydantic.functional_serializers import SerializerFunctionWrapHandler
from pydantic.functional_validators import ModelWrapValidatorHandler

from prime_composer.config.base import BaseConfig


class Weighted(Protocol):
    """A ``trainer.loss.<name>`` section."""

    weight: float


class Switched(Protocol):
    """An ``orchestrator.<name>`` section."""

    enabled: bool


def _plugin_configs(kind: Literal["loss", "orchestrator"], builtin: set[str]) -> dict[str, type[BaseConfig]]:
    from prime_composer.channels.spec import channels

    found: dict[str, type[BaseConfig]] = {}
    for spec in channels():
        config = spec.loss_config if kind == "loss" else spec.orchestrator_config
        if config is not None and spec.name not in builtin:
            found[spec.name] = config
    return found


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

"""Shared keys: set once at the top of ``RLConfig``, copied into every section that has them.

Rule, per leaf (e.g. ``model.name``, ``max_steps``):
- set at the top level: every section gets that value; a section that set a different one is an
  error (it would silently train one model and sample from another);
- not set at the top but set by sections (PRIME-RL's ``--trainer @ t.toml`` form): they must
  agree, and the agreed value becomes the top-level one and reaches the other sections;
- set nowhere: the top-level default reaches every section.

A nested section (``model``, ``transport.weights_origin``) is unified leaf by leaf; an optional
one (``X | None``) that is absent at the top or in some section is one value, compared whole.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from prime_composer.config.cli import origin_of
from prime_composer.config.common import SHARED_KEYS
from prime_composer.config.errors import ConfigError
from prime_composer.config.processes import SECTION_NAMES as SECTIONS


def _unify(
    top: BaseModel,
    name: str,
    top_explicit: bool,
    holders: list[tuple[str, BaseModel, bool]],
    dotted: str,
    origins: dict[str, str],
) -> None:
    """Unify field ``name`` of ``top`` with the same field of each (section, object, explicit)."""
    top_value: Any = getattr(top, name)
    top_explicit = top_explicit and name in top.model_fields_set
    # A nested section is unified field by field where every copy of it is there; an optional one
    # (``X | None``) absent at the top or in a section is one value, compared and copied whole.
    if isinstance(top_value, BaseModel) and all(
        isinstance(getattr(obj, name), BaseModel) for _, obj, _ in holders
    ):
        for sub in type(top_value).model_fields:
            _unify(
                top_value,
                sub,
                top_explicit,
                [(s, getattr(obj, name), exp and name in obj.model_fields_set) for s, obj, exp in holders],
                f"{dotted}.{sub}",
                origins,
            )
        return
    explicit = [(s, getattr(obj, name)) for s, obj, exp in holders if exp and name in obj.model_fields_set]
    if top_explicit:
        for section, value in explicit:
            if value != top_value:
                raise ConfigError(
                    f"{origin_of(f'{section}.{dotted}', origins)}: {section}.{dotted} = {value!r} conflicts "
                    f"with {dotted} = {top_value!r} ({origin_of(dotted, origins)}); {dotted} is shared by "
                    f"every process: set it once at the top level"
                )
    elif explicit:
        first_section, first_value = explicit[0]
        for section, value in explicit[1:]:
            if value != first_value:
                raise ConfigError(
                    f"{origin_of(f'{section}.{dotted}', origins)}: {section}.{dotted} = {value!r} conflicts "
                    f"with {first_section}.{dotted} = {first_value!r} "
                    f"({origin_of(f'{first_section}.{dotted}', origins)}); {dotted} is shared by every "
                    f"process: set it once at the top level"
                )
        setattr(top, name, first_value)
        top_value = first_value
    for _, obj, _ in holders:
        if getattr(obj, name) != top_value:
            # A copy: sections never share one nested object (a change to one reaches no other).
            setattr(
                obj, name, top_value.model_copy(deep=True) if isinstance(top_value, BaseModel) else top_value
            )


def unify_shared_keys(
    config: Any,
    origins: dict[str, str],
    keys: tuple[str, ...] = SHARED_KEYS,
    sections: tuple[str, ...] = SECTIONS,
) -> Any:
    """Apply the rule above to every key in ``keys`` (``SHARED_KEYS``) across ``sections`` (every
    process's), in place; returns ``config``."""
    for key in keys:
        present = [s for s in sections if getattr(config, s) is not None]  # optional sections may be absent
        holders = [
            (section, getattr(config, section), True)
            for section in present
            if key in type(getattr(config, section)).model_fields and section in config.model_fields_set
        ]
        # Sections never mentioned anywhere still take the shared value.
        passive = [
            (section, getattr(config, section), False)
            for section in present
            if key in type(getattr(config, section)).model_fields and section not in config.model_fields_set
        ]
        _unify(config, key, True, holders + passive, key, origins)
    return config

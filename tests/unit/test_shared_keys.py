"""Shared keys (``config/shared.py``) with an optional nested section inside a shared key: set at
the top, in a section, in two sections, or nowhere, it reaches every section by the one rule
(set once, or agreed), never an ``AttributeError``."""

from __future__ import annotations

import pytest

from prime_composer.config.base import BaseConfig
from prime_composer.config.errors import ConfigError
from prime_composer.config.shared import unify_shared_keys


class Origin(BaseConfig):
    host: str = "127.0.0.1"
    port: int = 0


class Shared(BaseConfig):
    kind: str = "filesystem"
    origin: Origin | None = None
    """The optional nested section: absent by default."""


class Section(BaseConfig):
    shared: Shared = Shared()


class Top(BaseConfig):
    shared: Shared = Shared()
    trainer: Section | None = Section()
    orchestrator: Section | None = Section()


def unify(data: dict) -> Top:
    config = Top.model_validate(data)
    return unify_shared_keys(config, {}, keys=("shared",), sections=("trainer", "orchestrator"))


def _origins(config: Top) -> list[Origin | None]:
    assert config.trainer is not None and config.orchestrator is not None
    return [config.shared.origin, config.trainer.shared.origin, config.orchestrator.shared.origin]


def test_set_at_the_top_it_reaches_every_section() -> None:
    config = unify({"shared": {"origin": {"port": 7}}})
    assert _origins(config) == [Origin(port=7)] * 3


def test_set_in_one_section_it_becomes_the_top_value_and_reaches_the_others() -> None:
    config = unify({"trainer": {"shared": {"origin": {"port": 7}}}, "orchestrator": {}})
    assert _origins(config) == [Origin(port=7)] * 3


def test_sections_that_agree_are_fine_and_sections_that_differ_are_an_error() -> None:
    # Absent at the top, the optional section is one value: compared whole between the sections.
    same = {"shared": {"origin": {"port": 7}}}
    assert _origins(unify({"trainer": same, "orchestrator": same})) == [Origin(port=7)] * 3
    with pytest.raises(
        ConfigError,
        match=r"orchestrator\.shared\.origin = Origin\(host='127\.0\.0\.1', port=8\) conflicts with trainer\.shared\.origin = Origin\(.*port=7\)",
    ):
        unify({"trainer": same, "orchestrator": {"shared": {"origin": {"port": 8}}}})


def test_a_section_that_contradicts_the_top_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.shared\.origin = None conflicts with shared\.origin"):
        unify({"shared": {"origin": {"port": 7}}, "trainer": {"shared": {"origin": None}}})


def test_set_nowhere_it_stays_absent_and_sections_do_not_share_one_object() -> None:
    config = unify({"trainer": {}, "orchestrator": {}})
    assert _origins(config) == [None] * 3
    config = unify({"shared": {"origin": {"port": 7}}})
    assert config.trainer is not None and config.orchestrator is not None
    config.trainer.shared.origin.port = 9  # type: ignore[union-attr]
    assert config.orchestrator.shared.origin == Origin(port=7)


def test_an_absent_optional_section_is_skipped() -> None:
    config = Top.model_validate({"shared": {"origin": {"port": 7}}, "orchestrator": None})
    unify_shared_keys(config, {}, keys=("shared",), sections=("trainer", "orchestrator"))
    assert config.trainer is not None and config.trainer.shared.origin == Origin(port=7)

"""Pydantic model introspection shared by the command line (``cli.py``) and ``--help`` (``help.py``)."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel


def submodel(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel inside ``annotation`` (``M``, ``M | None``), or None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [m for a in typing.get_args(annotation) if (m := submodel(a)) is not None]
        return models[0] if len(models) == 1 else None
    return None


def list_item_model(annotation: Any) -> type[BaseModel] | None:
    """``M`` for ``list[M]`` annotations (e.g. ``[[orchestrator.env]]`` tables)."""
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation) or (None,)
        return submodel(item)
    return None

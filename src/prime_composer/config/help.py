"""``--help``: every field of a config model, with its type, default and docstring."""

from __future__ import annotations

import json
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from prime_composer.config.introspect import list_item_model, submodel


def _type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(annotation)) + "}"
    name = getattr(annotation, "__name__", None)
    if name and not typing.get_args(annotation):
        return name.upper() if name in ("int", "float", "str", "bool") else name
    return str(annotation).replace("typing.", "").replace("pathlib.", "")


def _default(info: Any) -> str:
    if info.default is PydanticUndefined:
        return "required" if info.default_factory is None else repr(info.default_factory())
    value = info.default
    if isinstance(value, BaseModel):
        return ""
    try:
        return json.dumps(value, default=str)
    except TypeError:
        return repr(value)


def _lines(model: type[BaseModel], prefix: str, out: list[str]) -> None:
    sections = []
    for name, info in model.model_fields.items():
        dotted = f"{prefix}{name}"
        nested = submodel(info.annotation)
        if nested is not None:
            sections.append((dotted, nested, info.description))
            continue
        item = list_item_model(info.annotation)
        flag = f"--{dotted}"
        if info.annotation is bool:
            flag = f"--{dotted} / --no-{dotted}"
        elif item is None:
            flag = f"{flag} {_type_name(info.annotation)}"
        default = _default(info)
        out.append(f"  {flag}" + (f"  [default: {default}]" if default else ""))
        if info.description:
            out.extend(f"      {line.strip()}" for line in info.description.strip().splitlines())
        if item is not None:
            out.append(f"      A list of [[{dotted}]] tables, each with:")
            sub: list[str] = []
            _lines(item, "", sub)
            out.extend("    " + line for line in sub)
    for dotted, nested, description in sections:
        out.append("")
        out.append(f"[{dotted}]" + (f"  {description.strip().splitlines()[0]}" if description else ""))
        _lines(nested, dotted + ".", out)


def render_help(
    model: type[BaseModel],
    *,
    prog: str,
    describe: str = "",
    env_prefix: str = "",
    aliases: dict[str, str] | None = None,
) -> str:
    out = [
        f"usage: {prog} [@ file.toml ...] [--section @ file.toml ...] [--dotted.key VALUE ...] [--dry-run]",
        "",
    ]
    if describe:
        out += [describe.strip(), ""]
    out += [
        "Later files override earlier ones; --flags override files; environment variables",
        f"({env_prefix}KEY__SUBKEY) sit below files; defaults below everything.",
        "  --dry-run   print the resolved config as JSON and exit",
        "  -h, --help  show this message",
    ]
    for alias, target in (aliases or {}).items():
        out.append(f"  {alias:<11} same as --{target.replace('=true', '')}")
    out.append("")
    _lines(model, "", out)
    return "\n".join(out)

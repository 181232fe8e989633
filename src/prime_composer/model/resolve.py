"""Turn a ``model.name`` from the config into something ``from_pretrained`` accepts."""

from __future__ import annotations

from pathlib import Path

from prime_composer.integrity import MANIFEST_NAME, verify_manifest

BUILTIN_PREFIX = "builtin:"
BUILTIN_MODELS = ("tiny-qwen3", "smollm2-135m-instruct")
SMOLLM2 = BUILTIN_PREFIX + "smollm2-135m-instruct"
"""SmolLM2-135M-Instruct from the GGUF file on PyPI (``model/smollm2.py``; the ``smollm2`` extra)."""


def resolve_model_name(name: str) -> str:
    """Hub ids and local paths pass through; ``builtin:tiny-qwen3`` is built once and cached;
    ``builtin:smollm2-135m-instruct`` is the folder holding SmolLM2's GGUF file (downloaded from
    PyPI once; the config sets ``model.gguf_file`` to it).

    A local directory that holds ``MANIFEST.json`` (one this project wrote: the warm-up's
    ``sft/final``, an export) is checked against it first, so a damaged file is an error naming it
    rather than a model that loads with different weights."""
    if not name.startswith(BUILTIN_PREFIX):
        directory = Path(name).expanduser()
        if (directory / MANIFEST_NAME).is_file():
            verify_manifest(directory)
        return name
    builtin = name.removeprefix(BUILTIN_PREFIX)
    if builtin == "tiny-qwen3":
        from prime_composer.model.tiny import build_tiny_model

        return str(build_tiny_model())
    if builtin == "smollm2-135m-instruct":
        from prime_composer.model.smollm2 import smollm2_dir

        return str(smollm2_dir())
    raise ValueError(
        f"model.name = {name!r}: unknown built-in model; choose one of "
        + ", ".join(BUILTIN_PREFIX + b for b in BUILTIN_MODELS)
    )

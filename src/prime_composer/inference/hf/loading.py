"""Load the served model and tokenizer with ``from_pretrained`` (hub id, local directory, GGUF).

The ``hf`` backend's decode loop builds its own attention masks and KV cache layout, so it checks
here that the model is one it can drive: a decoder whose layers all use full attention, with an
attention implementation that takes explicit 4D masks (``attention.NAME``, selected here, or
transformers' ``sdpa`` / ``eager``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from prime_composer.config.base import ModelConfig
from prime_composer.inference.hf import attention
from prime_composer.model.resolve import resolve_model_name

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SUPPORTED_ATTENTION = (attention.NAME, "sdpa", "eager")


def resolve_device(spec: str) -> torch.device:
    """``auto`` is ``cuda`` when a GPU is visible, else ``cpu``; anything else must be usable."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError as e:
        raise ValueError(
            f"inference.device = {spec!r} is not a device; use auto, cpu, cuda or cuda:<index>"
        ) from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"inference.device = {spec!r}, but no GPU is visible; use 'cpu' or 'auto'")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"inference.device = {spec!r}: the hf backend runs on cpu or cuda only")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on a GPU and float32 on a CPU (as ``model.dtype`` documents)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def load_model_and_tokenizer(model_config: ModelConfig, device: torch.device) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for ``model_config``, the model in eval mode on ``device``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_name(model_config.name)
    kwargs: dict[str, Any] = {"trust_remote_code": model_config.trust_remote_code}
    if model_config.revision is not None:
        kwargs["revision"] = model_config.revision
    if model_config.gguf_file is not None:
        kwargs["gguf_file"] = model_config.gguf_file
    dtype = resolve_dtype(model_config.dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attention.register(), **kwargs
    )
    model.to(device).eval()
    check_supported(model, model_config.name)
    logger.info("loaded %s (%s, %s) on %s", model_config.name, type(model).__name__, dtype, device)
    return model, tokenizer


def check_supported(model: Any, name: str) -> None:
    """Refuse models the decode loop cannot serve correctly, saying what to use instead."""
    config = model.config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise ValueError(
            f"model.name = {name!r} has {', '.join(other)} layers; the hf backend serves full-attention "
            "models only: use inference.backend = 'vllm' for this model"
        )
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in _SUPPORTED_ATTENTION:
        raise ValueError(
            f"model.name = {name!r} loaded with attention implementation {implementation!r}; the hf backend "
            f"needs one of {_SUPPORTED_ATTENTION} (it passes explicit 4D masks)"
        )


def max_context(model: Any, configured: int | None) -> int:
    """The served context length: the configured one, or the model's ``max_position_embeddings``."""
    native = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if configured is not None:
        if native is not None and configured > native:
            raise ValueError(
                f"inference.max_model_len = {configured} exceeds the model's max_position_embeddings "
                f"({native}); lower it or leave it unset"
            )
        return configured
    if native is None:
        raise ValueError("the model config has no max_position_embeddings: set inference.max_model_len")
    return int(native)

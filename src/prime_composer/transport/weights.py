"""The one weight format: what the trainer publishes and both inference backends load.

A published step is a directory ``<root>/step_<N>/`` holding ``model.safetensors`` and
``config.json`` (no tokenizer: the server already has it), laid out the way
``save_pretrained`` lays out a checkpoint, so vLLM and ``from_pretrained`` read it as they read any
Hugging Face model directory:

- keys are checkpoint keys (``model.layers.0.self_attn.q_proj.weight``); for a
  ``PreTrainedModel`` any in-memory weight conversion transformers applied at load time (e.g. fused
  MoE experts) is reverted, as ``save_pretrained`` does;
- a tied output embedding is written once, under the input-embedding key, as ``save_pretrained``
  does (safetensors cannot alias tensors);
- ``config.json`` has no ``quantization_config`` (the weights are dense, even when the model was
  loaded from a GGUF file) and its ``dtype`` names the dtype the tensors are stored in.

Atomicity: everything is written into a hidden temporary directory next to the target, renamed
into place, and only then is the ``STABLE`` marker written inside it. A reader that requires
``STABLE`` (``load_weights`` does by default, ``latest_stable`` only lists such steps) never sees a
half-written step.

Usage::

    path = publish_weights(model, model.config, output_dir / "broadcasts", step)  # trainer
    state_dict = load_weights(path)                                              # server
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
STABLE_MARKER = "STABLE"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_path(root: Path, step: int) -> Path:
    """Where step ``step`` is (or will be) published under ``root``."""
    return Path(root) / f"step_{step}"


def publish_weights(
    model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
    hf_config: Any,
    root: Path,
    step: int,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``<root>/step_<step>/`` (weights + config, then ``STABLE``) and return its path.

    ``model_or_state_dict`` is the policy (a ``PreTrainedModel``) or its full state dict with
    Hugging Face keys. With FSDP, gather first (``get_model_state_dict(..., full_state_dict=True,
    cpu_offload=True)``) and call this on rank 0 only; a DTensor left in the input is gathered
    with ``full_tensor``, which is a collective that every rank would have to join.
    ``hf_config`` is the model's ``PretrainedConfig`` (or a plain dict).
    ``dtype`` casts floating-point tensors before writing (e.g. ``torch.bfloat16`` for vLLM);
    ``None`` keeps them as they are. Re-publishing an existing step replaces it.
    """
    if step < 0:
        raise ValueError(f"publish_weights: step must be >= 0, got {step}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    config = _config_dict(hf_config)
    state_dict = _checkpoint_state_dict(model_or_state_dict, hf_config, dtype)
    stored_dtypes = {t.dtype for t in state_dict.values() if t.is_floating_point()}
    if len(stored_dtypes) == 1:
        config["dtype"] = str(next(iter(stored_dtypes))).removeprefix("torch.")
        config.pop("torch_dtype", None)  # the old spelling of the same field; keep one

    target = step_path(root, step)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step_{step}-", dir=root))
    try:
        save_file(state_dict, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _fsync_dir_files(tmp)
        if target.exists():
            # Re-publishing a step (e.g. after a resume): move the old one aside first, so the
            # rename below is the only moment the step changes.
            stale = Path(tempfile.mkdtemp(prefix=f".stale-step_{step}-", dir=root))
            os.replace(target, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    marker = target / STABLE_MARKER
    marker.write_text(json.dumps({"step": step}) + "\n")
    return target


def is_stable(path: Path) -> bool:
    """Whether ``path`` is a completely published step (its ``STABLE`` marker exists)."""
    return (Path(path) / STABLE_MARKER).is_file()


def load_weights(path: Path, require_stable: bool = True) -> dict[str, torch.Tensor]:
    """Read a published step (single file or sharded with an index) into a CPU state dict.

    Raises ``FileNotFoundError`` naming what is missing; with ``require_stable`` (the default) a
    directory without ``STABLE`` is refused, because it may still be being written.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"weight directory {path} does not exist")
    if require_stable and not is_stable(path):
        raise FileNotFoundError(
            f"weight directory {path} has no {STABLE_MARKER} marker: it is incomplete or still "
            "being written; publish it with publish_weights"
        )
    single, index = path / WEIGHTS_NAME, path / INDEX_NAME
    if single.is_file():
        return load_file(str(single))
    if index.is_file():
        # Sharded checkpoints (what save_pretrained writes for big models) load too.
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state_dict: dict[str, torch.Tensor] = {}
        for shard in shards:
            state_dict.update(load_file(str(path / shard)))
        return state_dict
    raise FileNotFoundError(f"weight directory {path} has neither {WEIGHTS_NAME} nor {INDEX_NAME}")


def latest_stable(root: Path) -> tuple[int, Path] | None:
    """The newest completely published step under ``root`` as ``(step, path)``, or ``None``."""
    root = Path(root)
    if not root.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir() and is_stable(entry):
            step = int(match.group(1))
            if best is None or step > best[0]:
                best = (step, entry)
    return best


def parse_step(path: Path) -> int | None:
    """The step number of a ``step_<N>`` directory, or ``None`` for any other name."""
    match = _STEP_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


def _config_dict(hf_config: Any) -> dict[str, Any]:
    if isinstance(hf_config, Mapping):
        config = dict(hf_config)
    elif hasattr(hf_config, "to_json_string"):
        # to_json_string(use_diff=True) is exactly what save_pretrained writes to config.json.
        config = json.loads(hf_config.to_json_string(use_diff=True))
    else:
        raise TypeError(
            f"publish_weights: hf_config must be a transformers PretrainedConfig or a dict, got "
            f"{type(hf_config).__name__}"
        )
    # The published tensors are dense; a quantization_config (e.g. left by GGUF loading) would
    # make loaders look for quantized weights that are not there.
    config.pop("quantization_config", None)
    return config


def _checkpoint_state_dict(
    model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
    hf_config: Any,
    dtype: torch.dtype | None,
) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors under checkpoint keys, tied duplicates removed."""
    if isinstance(model_or_state_dict, torch.nn.Module):
        model: torch.nn.Module | None = model_or_state_dict
        raw = dict(model_or_state_dict.state_dict())
        # What save_pretrained drops: a declared tied key whose tensor really is shared.
        drop = {key for key in _tied_keys(model_or_state_dict) if key in raw and _is_aliased(key, raw)}
    else:
        model = None
        raw = dict(model_or_state_dict)
        # A gathered state dict has lost the aliasing; the config says whether the output
        # embedding is tied to the input one.
        drop = {"lm_head.weight"} if _ties_embeddings(hf_config) else set()
    state_dict: dict[str, torch.Tensor] = {}
    for key, tensor in raw.items():
        if key in drop:
            continue
        if hasattr(tensor, "full_tensor"):  # a DTensor shard: gather the whole tensor
            tensor = tensor.full_tensor()
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        # clone: safetensors refuses tensors that share storage, and a view of a bigger buffer
        # would otherwise be written whole.
        state_dict[key] = tensor.to("cpu").contiguous().clone()
    if model is not None and hasattr(model, "config") and hasattr(model, "_tied_weights_keys"):
        # A PreTrainedModel: undo in-memory weight conversions as save_pretrained does.
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion

        state_dict = dict(revert_weight_conversion(cast(PreTrainedModel, model), state_dict))
    return state_dict


def _tied_keys(model: torch.nn.Module) -> set[str]:
    """Keys transformers declares as tied aliases (``_tied_weights_keys`` of every submodule)."""
    keys: set[str] = set()
    for name, module in model.named_modules():
        tied = getattr(module, "_tied_weights_keys", None) or {}
        keys.update(f"{name}.{k}" if name else k for k in tied)
    return keys


def _is_aliased(key: str, state_dict: Mapping[str, torch.Tensor]) -> bool:
    ptr = state_dict[key].untyped_storage().data_ptr()
    return any(
        other != key and tensor.untyped_storage().data_ptr() == ptr for other, tensor in state_dict.items()
    )


def _ties_embeddings(hf_config: Any) -> bool:
    if isinstance(hf_config, Mapping):
        text_config = hf_config.get("text_config")
        if isinstance(text_config, Mapping) and "tie_word_embeddings" in text_config:
            return bool(text_config["tie_word_embeddings"])
        return bool(hf_config.get("tie_word_embeddings", False))
    text_config = (
        hf_config.get_text_config(decoder=True) if hasattr(hf_config, "get_text_config") else hf_config
    )
    return bool(getattr(text_config, "tie_word_embeddings", False))


def _fsync_dir_files(directory: Path) -> None:
    """Flush the written files to disk before the rename makes them visible."""
    for entry in directory.iterdir():
        with open(entry, "rb") as f:
            os.fsync(f.fileno())

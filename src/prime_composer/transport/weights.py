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

Integrity: ``MANIFEST.json`` (``prime_composer.integrity``: size and SHA-256 of every file) is
written after the files and before ``STABLE``; ``load_weights`` checks the files it reads against
it, so a truncated, zeroed or bit-flipped file is refused (``IntegrityError``) instead of served.
Weights with a NaN or an infinity are never written (``publish_weights`` raises, naming the
tensor) and never returned (``load_weights`` raises ``NonFiniteWeightsError``): one such value
makes every logprob the server returns NaN.

A LoRA run publishes adapters instead (``transport/adapter.py``): the same directory, atomicity and
manifest, with peft's ``adapter_model.safetensors`` and ``adapter_config.json`` as the files;
``verify_published`` and ``load_weights`` read either kind.

Usage::

    path = publish_weights(model, model.config, output_dir / "broadcasts", step)  # trainer
    state_dict = load_weights(path)                                              # server
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file

from prime_composer.integrity import IntegrityError, read_manifest, verify_manifest, write_manifest
from prime_composer.io import atomic_write_text

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
"""A LoRA step (``transport/adapter.py``) holds this and ``ADAPTER_CONFIG_NAME`` instead, in peft's layout."""
ADAPTER_CONFIG_NAME = "adapter_config.json"
STABLE_MARKER = "STABLE"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class NonFiniteWeightsError(ValueError):
    """A tensor holds NaN or infinite values (publishing or loading such weights is refused)."""


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

    Raises ``NonFiniteWeightsError`` naming the first tensor with a NaN or an infinity (after the
    cast, which can overflow), before anything is written.
    """
    if step < 0:
        raise ValueError(f"publish_weights: step must be >= 0, got {step}")
    config = _config_dict(hf_config)
    state_dict = _checkpoint_state_dict(model_or_state_dict, hf_config, dtype)
    check_finite(state_dict, f"publish_weights (step {step})")
    stored_dtypes = {t.dtype for t in state_dict.values() if t.is_floating_point()}
    if len(stored_dtypes) == 1:
        config["dtype"] = str(next(iter(stored_dtypes))).removeprefix("torch.")
        config.pop("torch_dtype", None)  # the old spelling of the same field; keep one

    def write(tmp: Path) -> None:
        save_file(state_dict, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    return write_step(root, step, write)


def write_step(root: Path, step: int, write: Callable[[Path], None]) -> Path:
    """Publish ``<root>/step_<step>/`` atomically: ``write`` fills a hidden temporary directory,
    then the files are fsynced, listed in ``MANIFEST.json``, renamed into place and marked
    ``STABLE``. Every published format (whole weights, LoRA adapters) goes through here."""
    if step < 0:
        raise ValueError(f"publishing: step must be >= 0, got {step}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    target = step_path(root, step)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step_{step}-", dir=root))
    try:
        write(tmp)
        _fsync_dir_files(tmp)
        write_manifest(tmp)
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
    atomic_write_text(target / STABLE_MARKER, json.dumps({"step": step}) + "\n")
    return target


def is_stable(path: Path) -> bool:
    """Whether ``path`` is a completely published step (its ``STABLE`` marker exists)."""
    return (Path(path) / STABLE_MARKER).is_file()


def load_weights(
    path: Path, require_stable: bool = True, verify_digests: bool = True
) -> dict[str, torch.Tensor]:
    """Read a published step (single file or sharded with an index) into a CPU state dict.

    Checks, in order: the directory exists (``FileNotFoundError``); with ``require_stable`` (the
    default) it has ``STABLE`` (``FileNotFoundError``: it may still be being written); every file
    read is listed in ``MANIFEST.json`` with its size and, with ``verify_digests``, its SHA-256
    (``IntegrityError`` naming the file); no tensor holds NaN or inf (``NonFiniteWeightsError``
    naming it). ``verify_digests=False`` still checks sizes; it is for a caller that has just
    verified the digests itself (``verify_published``).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"weight directory {path} does not exist")
    if require_stable and not is_stable(path):
        raise FileNotFoundError(
            f"weight directory {path} has no {STABLE_MARKER} marker: it is incomplete or still "
            "being written; publish it with publish_weights"
        )
    files = verify_published(path) if verify_digests else _checked_sizes(path)
    state_dict: dict[str, torch.Tensor] = {}
    for name in files:
        if name not in (INDEX_NAME, ADAPTER_CONFIG_NAME):
            state_dict.update(load_file(str(path / name)))
    check_finite(state_dict, f"weights in {path}")
    return state_dict


def verify_published(path: Path) -> list[str]:
    """Check the weight files of step directory ``path`` against its ``MANIFEST.json`` (sizes and
    SHA-256); return their names (the index first, when sharded). Raises ``IntegrityError``
    naming the first bad or unlisted file, ``FileNotFoundError`` when there are no weights."""
    path = Path(path)
    if (path / ADAPTER_WEIGHTS_NAME).is_file():
        # The adapter's config holds its rank and scale: it is checked like the weights.
        verify_manifest(path, only=[ADAPTER_WEIGHTS_NAME, ADAPTER_CONFIG_NAME])
        return [ADAPTER_WEIGHTS_NAME]
    if (path / WEIGHTS_NAME).is_file():
        verify_manifest(path, only=[WEIGHTS_NAME])
        return [WEIGHTS_NAME]
    if (path / INDEX_NAME).is_file():
        verify_manifest(path, only=[INDEX_NAME])  # before trusting the shard list it holds
        files = [INDEX_NAME, *_shard_names(path)]
        verify_manifest(path, only=files[1:])
        return files
    raise FileNotFoundError(f"weight directory {path} has neither {WEIGHTS_NAME} nor {INDEX_NAME}")


def _checked_sizes(path: Path) -> list[str]:
    """The weight files of ``path``, each checked against the size its manifest lists (no digest)."""
    listed = read_manifest(path)
    if (path / ADAPTER_WEIGHTS_NAME).is_file():
        files = [ADAPTER_WEIGHTS_NAME, ADAPTER_CONFIG_NAME]
    elif (path / WEIGHTS_NAME).is_file():
        files = [WEIGHTS_NAME]
    elif (path / INDEX_NAME).is_file():
        files = [INDEX_NAME, *_shard_names(path)]
    else:
        raise FileNotFoundError(f"weight directory {path} has neither {WEIGHTS_NAME} nor {INDEX_NAME}")
    for name in files:
        entry = listed.get(name)
        if entry is None:
            raise IntegrityError(f"{path / name}: not listed in {path}/MANIFEST.json")
        size = (path / name).stat().st_size
        if size != entry["bytes"]:
            raise IntegrityError(
                f"{path / name}: {size} bytes but {entry['bytes']} were written (truncated or overwritten)"
            )
    return files


def _shard_names(path: Path) -> list[str]:
    try:
        weight_map = json.loads((path / INDEX_NAME).read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise IntegrityError(f"{path / INDEX_NAME}: not a safetensors index ({e})") from None
    bad = [s for s in shards if not isinstance(s, str) or Path(s).name != s or s in ("", ".", "..")]
    if bad:
        raise IntegrityError(f"{path / INDEX_NAME}: shard names must be plain file names, got {bad[:3]}")
    return shards


def check_finite(state_dict: Mapping[str, torch.Tensor], what: str) -> None:
    """Raise ``NonFiniteWeightsError`` naming the first floating-point tensor with a NaN or inf.

    One ``aminmax`` pass per tensor (NaN propagates to both ends, an infinity shows at one):
    ~10 ms per 100 MB on one core, 14x less than ``isfinite(t).all()``, which allocates a mask.
    """
    for name, tensor in state_dict.items():
        if tensor.numel() == 0 or not (tensor.is_floating_point() or tensor.is_complex()):
            continue
        try:
            low, high = torch.aminmax(tensor)
            finite = math.isfinite(float(low)) and math.isfinite(float(high))
        except (RuntimeError, TypeError):  # dtypes aminmax does not cover (complex, float8)
            finite = bool(torch.isfinite(tensor).all())
        if not finite:
            num_bad = int((~torch.isfinite(tensor)).sum())
            raise NonFiniteWeightsError(
                f"{what}: tensor {name!r} has {num_bad} non-finite values (NaN or inf) out of "
                f"{tensor.numel()}; refusing weights that would make every logprob NaN"
            )


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

"""LoRA adapters on the wire: what a LoRA run publishes each step instead of the whole model.

A published adapter step is a ``<root>/step_<N>/`` directory like a whole-weights step
(``transport/weights.py``: written by ``write_step``, so the same atomic rename, ``MANIFEST.json``
and ``STABLE`` marker), holding peft's own layout, which vLLM's LoRA loading and
``PeftModel.from_pretrained`` both read:

- ``adapter_model.safetensors``: ``base_model.model.<module>.lora_A.weight`` (``[r, in]``) and
  ``...lora_B.weight`` (``[out, r]``) for every adapted linear layer ``<module>``;
- ``adapter_config.json``: peft's ``LoraConfig`` (``r``, ``lora_alpha``, ``target_modules``, ...).

The update of a layer is ``delta = (lora_alpha / r) * B @ A`` (``lora_alpha / sqrt(r)`` with
``use_rslora``), so a served weight is ``W0 + delta`` where ``W0`` is the *base* weight, never the
weight of the previous step: applying adapter ``N + 1`` replaces adapter ``N``. ``merged_weights``
computes that for the embedded server; per-layer ranks or scales (``rank_pattern``,
``alpha_pattern``) and DoRA are refused (the trainer never writes them).

It imports only torch and safetensors, as ``transport/weights.py`` does, so vLLM's processes can
read it too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from prime_composer.transport.weights import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    check_finite,
    load_weights,
    write_step,
)

PEFT_PREFIX = "base_model.model."
"""What peft puts in front of the base model's module names in an adapter file."""


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter read from a published step: its tensors (peft keys) and peft's config."""

    state_dict: dict[str, torch.Tensor]
    config: dict[str, Any]

    @property
    def scale(self) -> float:
        """``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``)."""
        return adapter_scale(self.config)


def is_adapter(path: Path) -> bool:
    """Whether the step directory ``path`` holds an adapter (else whole weights)."""
    return (Path(path) / ADAPTER_CONFIG_NAME).is_file()


def publish_adapter(
    state_dict: Mapping[str, torch.Tensor], config: Mapping[str, Any], root: Path, step: int
) -> Path:
    """Write the adapter ``state_dict`` (peft keys, as ``get_peft_model_state_dict`` returns them)
    and its peft ``config`` (a JSON-able dict) as ``<root>/step_<step>/``; return its path.

    Raises ``NonFiniteWeightsError`` naming a tensor with a NaN or an infinity, and ``ValueError``
    for an adapter this module could not apply, before anything is written.
    """
    tensors = {k: t.detach().to("cpu").contiguous().clone() for k, t in state_dict.items()}
    check_finite(tensors, f"publish_adapter (step {step})")
    adapter_scale(config)  # refuses configs that merged_weights could not apply
    _lora_pairs(tensors)

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG_NAME).write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")

    return write_step(root, step, write)


def load_adapter(path: Path, verify_digests: bool = True) -> Adapter:
    """Read a published adapter step, checked as ``load_weights`` checks weights (``STABLE``,
    the manifest's sizes and digests, config included; finite values)."""
    state_dict = load_weights(path, verify_digests=verify_digests)
    config = json.loads((Path(path) / ADAPTER_CONFIG_NAME).read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{Path(path) / ADAPTER_CONFIG_NAME}: not a JSON object")
    return Adapter(state_dict, config)


def adapter_scale(config: Mapping[str, Any]) -> float:
    """The factor of ``B @ A`` for peft ``config``; ``ValueError`` for what is not plain LoRA."""
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ValueError(f"adapter_config.json sets {key}: per-layer ranks or scales are not supported")
    if config.get("use_dora"):
        raise ValueError("adapter_config.json sets use_dora: DoRA adapters are not supported")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter_config.json: peft_type {config.get('peft_type')!r} is not LORA")
    try:
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"adapter_config.json needs numbers r and lora_alpha ({e})") from None
    if rank < 1:
        raise ValueError(f"adapter_config.json: r must be >= 1, got {rank}")
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def merged_weights(base: Mapping[str, torch.Tensor], adapter: Adapter) -> dict[str, torch.Tensor]:
    """``W0 + scale * B @ A`` for every adapted layer, under the base model's keys
    (``model.layers.0.self_attn.q_proj.weight``), in the base weight's dtype and device.

    ``base`` maps those keys to the base weights (not to a previous step's). The product and the
    sum are computed in float32. ``ValueError`` when the adapter names a layer ``base`` lacks or
    its shapes do not fit.
    """
    merged: dict[str, torch.Tensor] = {}
    scale = adapter.scale
    for key, (lora_a, lora_b) in _lora_pairs(adapter.state_dict).items():
        if key not in base:
            raise ValueError(f"the adapter adapts {key!r}, which the served model does not have")
        weight = base[key]
        if lora_a.shape[0] != lora_b.shape[1] or (lora_b.shape[0], lora_a.shape[1]) != tuple(weight.shape):
            raise ValueError(
                f"the adapter of {key!r} has A {tuple(lora_a.shape)} and B {tuple(lora_b.shape)}, which do "
                f"not fit the weight's {tuple(weight.shape)}"
            )
        delta = scale * (lora_b.to(weight.device, torch.float32) @ lora_a.to(weight.device, torch.float32))
        merged[key] = (weight.to(torch.float32) + delta).to(weight.dtype)
    return merged


def _lora_pairs(state_dict: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{"<module>.weight": (A, B)}`` from peft keys; ``ValueError`` for other or unpaired keys."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        name = key.removeprefix(PEFT_PREFIX)
        for half in ("lora_A", "lora_B"):
            suffix = f".{half}.weight"
            if name.endswith(suffix):
                halves.setdefault(name.removesuffix(suffix) + ".weight", {})[half] = tensor
                break
        else:
            raise ValueError(f"adapter tensor {key!r} is not a LoRA A or B matrix")
    unpaired = sorted(k for k, pair in halves.items() if len(pair) != 2)
    if unpaired:
        raise ValueError(f"the adapter has only one of A and B for {unpaired[:3]}")
    return {k: (pair["lora_A"], pair["lora_B"]) for k, pair in halves.items()}

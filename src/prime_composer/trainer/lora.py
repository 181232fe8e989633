"""LoRA on the trainer's policy (``[trainer.model.lora]``), with peft.

``apply_lora`` wraps the loaded model in a ``peft.PeftModel`` *before* FSDP2 sharding: every
targeted ``nn.Linear`` ``W0`` gets ``A`` (``[r, in]``, Kaiming-uniform) and ``B`` (``[out, r]``,
zeros, so step 0 is the base model exactly), the forward computes
``W0 x + (alpha / r) * B (A dropout(x))``, and every other parameter is frozen. The optimizer then
holds the adapter only (``optim.param_groups`` skips frozen parameters), FSDP2 shards frozen and
trainable parameters alike, and the loss code is unchanged (peft forwards the same arguments).

What moves because of LoRA:

- publishing: ``adapter_state_dict`` (the A and B matrices, gathered under FSDP) and
  ``adapter_config`` go out through ``transport/adapter.py`` each step: megabytes, not the model;
- checkpoints hold the adapter and its optimizer state, not the frozen base; ``base_fingerprint``
  (SHA-256 over the base weights, taken before wrapping) is recorded so that a resume on another
  base model is refused (``check_base``);
- the final export is the merged model or the adapter directory (``trainer.model.lora.export``).

peft is imported here only, so a run without LoRA never imports it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import nn

from prime_composer.config.errors import ConfigError
from prime_composer.config.trainer import LoraConfig

TARGETS_KEY = "trainer.model.lora.target_modules"


def apply_lora(model: nn.Module, cfg: LoraConfig) -> Any:
    """``model`` wrapped with fresh adapters on ``cfg.target_modules`` (a ``peft.PeftModel``);
    ``ConfigError`` naming the key when a target matches no linear layer, or matches a layer that
    is not an ``nn.Linear``."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    check_targets(model, cfg.target_modules)
    peft_config = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,  # type: ignore[arg-type]  # typed int, used as a float scale
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
    )
    return get_peft_model(model, peft_config)


def check_targets(model: nn.Module, targets: tuple[str, ...]) -> None:
    """Every target must name (as the last dotted parts of a module name) at least one
    ``nn.Linear`` and nothing else."""
    modules = dict(model.named_modules())
    for target in targets:
        matched = [n for n in modules if n == target or n.endswith("." + target)]
        if not matched:
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in modules.items() if isinstance(m, nn.Linear)})
            raise ConfigError(
                f"{TARGETS_KEY}: {target!r} matches no module of {type(model).__name__}; its linear layers "
                f"are named {linear}"
            )
        other = [n for n in matched if not isinstance(modules[n], nn.Linear)]
        if other:
            raise ConfigError(
                f"{TARGETS_KEY}: {target!r} matches {other[0]!r}, a {type(modules[other[0]]).__name__}: "
                "only linear layers can be adapted"
            )


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's whole tensors as CPU copies under peft's file keys
    (``base_model.model.<module>.lora_A.weight``). Collective under FSDP: every rank gathers the
    same parameters in the same order (each is small)."""
    from peft import get_peft_model_state_dict

    trainable = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            tensor = param.detach()
            full_tensor = getattr(tensor, "full_tensor", None)
            trainable[name] = (full_tensor() if full_tensor is not None else tensor).to("cpu", copy=True)
    return dict(get_peft_model_state_dict(model, state_dict=trainable))


def adapter_config(model: Any) -> dict[str, Any]:
    """peft's ``LoraConfig`` of ``model`` as the JSON object ``adapter_config.json`` holds."""
    config = model.peft_config["default"].to_dict()
    # Sets (target_modules) as sorted lists; enums are str subclasses and serialise as strings.
    return dict(json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, set) else str(v))))


def base_fingerprint(model: nn.Module) -> str:
    """SHA-256 over the names, dtypes, shapes and bytes of ``model``'s weights (call it on the
    base model, before ``apply_lora``): what a LoRA checkpoint is only valid on top of."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        data = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{data.dtype}|{tuple(data.shape)}\n".encode())
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def lora_record(model_name: str, fingerprint: str, cfg: LoraConfig) -> dict[str, Any]:
    """What a LoRA checkpoint records about the model it adapts (``meta.json``'s ``extra``)."""
    return {
        "base_model": model_name,
        "base_sha256": fingerprint,
        "rank": cfg.rank,
        "alpha": cfg.alpha,
        "target_modules": list(cfg.target_modules),
    }


def check_base(saved: dict[str, Any] | None, current: dict[str, Any] | None, where: str) -> None:
    """Refuse to resume adapters onto another base model or with another LoRA shape, and a LoRA
    run from a full fine-tuning checkpoint or the other way round (``ValueError`` saying which)."""
    if saved is None and current is None:
        return
    if saved is None:
        raise ValueError(
            f"{where} was saved by a full fine-tuning run: resume it without trainer.model.lora, or "
            "start the LoRA run in a new output directory"
        )
    if current is None:
        raise ValueError(f"{where} holds LoRA adapters: resume it with the same trainer.model.lora")
    if saved["base_sha256"] != current["base_sha256"]:
        raise ValueError(
            f"{where} holds adapters of another base model ({saved['base_model']!r}, weights SHA-256 "
            f"{saved['base_sha256'][:12]}...) than this run's {current['base_model']!r} "
            f"({current['base_sha256'][:12]}...): adapters only apply to the weights they were trained on; "
            "set model.name to the checkpoint's base model"
        )
    for key in ("rank", "alpha", "target_modules"):
        if saved[key] != current[key]:
            raise ValueError(
                f"{where} has adapters with {key} = {saved[key]!r}, this run asks for {current[key]!r} "
                f"(trainer.model.lora.{key}); resume with the saved value"
            )


def merged_model(model: Any) -> nn.Module:
    """A plain transformers model with the adapter folded into its weights (``merge_and_unload``
    on a copy, so the training model keeps its adapter). Single process only: under FSDP gather
    the adapter first."""
    import copy

    return copy.deepcopy(model).merge_and_unload()

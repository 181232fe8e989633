"""The decoder forward of the decode loop for Llama / Qwen2 / Qwen3 models on CPU, with every
linear layer prepacked for oneDNN and fused with what follows it.

Why: a decode step is a handful of ``[rows, hidden] x [hidden, out]`` products per layer with few
rows (16 in the bench), where torch's default CPU kernel (MKL sgemm through ``F.linear``) reaches
~45 GFLOPS on this machine and oneDNN with the weight packed once into its own layout ~55-72
(``docs/experiments.md``, 2026-12-04). Per layer this runs four products instead of seven:

- ``q``, ``k`` and ``v`` as one product over their concatenated weights;
- ``o_proj`` with the residual added in the kernel's epilogue;
- ``gate_proj`` with SiLU in its epilogue, then ``up_proj`` multiplied by it in its epilogue
  (the SiLU-mul without a separate pass);
- ``down_proj`` with the residual added in the epilogue.

Norms, rotary embeddings and attention are the model's own computations written out (RMSNorm in
float32 as transformers does; the model's own rotary module; torch's SDPA with grouped heads and
the loop's boolean mask). The same function runs prefills (``q_len > 1``) and decode steps.

It is used only where it is the same computation, checked once on a probe input against the
model's own forward (``fused_decoder``); otherwise the engine runs the model's forward.

Weights: the packed copies are rebuilt whenever a source parameter changed in place. Every call
compares the parameters' version counters (bumped by each in-place write, e.g. a weight update's
``copy_``) with those at packing time, so a stale packed weight is never used, whichever code
path wrote the parameters; ``refresh`` repacks at once.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from prime_composer.inference.hf.kv_cache import BatchKVCache

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
_PROBE_TOL = 1e-4  # relative to the largest hidden value; measured differences are ~1e-6

_linear = torch.ops.mkldnn._linear_pointwise
_linear_binary = torch.ops.mkldnn._linear_pointwise.binary  # (x W^T + b) <op> other, in one kernel


def _pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm`` (float32 inputs)."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Layer:
    def __init__(self, layer: Any, rows: int) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.attn = attn
        self.q_size = attn.q_proj.out_features
        self.kv_size = attn.k_proj.out_features
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.ln1 = layer.input_layernorm
        self.ln2 = layer.post_attention_layernorm
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)
        self._attn_mods = (attn.q_proj, attn.k_proj, attn.v_proj)
        self._o, self._g, self._u, self._d = attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self._rows = rows
        self.pack()

    def pack(self) -> None:
        with torch.no_grad():
            self.qkv = _pack(torch.cat([m.weight for m in self._attn_mods]), self._rows)
            biases = [m.bias for m in self._attn_mods]
            self.qkv_bias = None if biases[0] is None else torch.cat(biases).detach()
            self.o = _pack(self._o.weight, self._rows)
            self.gate = _pack(self._g.weight, self._rows)
            self.up = _pack(self._u.weight, self._rows)
            self.down = _pack(self._d.weight, self._rows)

    def modules(self) -> list[Any]:
        return [*self._attn_mods, self._o, self._g, self._u, self._d]


class FusedDecoder:
    """``decoder(input_ids, position_ids, allowed, cache) -> hidden [rows, hidden]``: the final
    (normed) hidden state at each row's last position; ``cache`` gets the new keys/values."""

    def __init__(self, model: Any, rows: int = 16) -> None:
        decoder = model.get_decoder()
        self._embed = decoder.embed_tokens
        self._rotary = decoder.rotary_emb
        self._norm = decoder.norm
        self._layers = [_Layer(layer, rows) for layer in decoder.layers]
        self._linears = [m for layer in self._layers for m in layer.modules()]
        self._versions = self._current_versions()

    def _current_versions(self) -> list[tuple[int, int, int]]:
        """Identity and version counter of every packed weight (and bias: -1 without one)."""
        return [
            (id(m.weight), m.weight._version, -1 if m.bias is None else m.bias._version)
            for m in self._linears
        ]

    def refresh(self) -> None:
        """Repack every layer from the model's current weights."""
        for layer in self._layers:
            layer.pack()
        self._versions = self._current_versions()

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        allowed: torch.Tensor,
        cache: BatchKVCache,
    ) -> torch.Tensor:
        """``input_ids``/``position_ids`` ``[rows, q]``, ``allowed`` bool ``[rows, 1, q, keys]``
        (keys = the cache's length + q)."""
        if self._current_versions() != self._versions:
            self.refresh()  # a parameter was written in place since packing (a weight update)
        rows, q_len = input_ids.shape
        h = self._embed(input_ids)
        cos, sin = self._rotary(h, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [rows, 1, q, dim]
        for index, layer in enumerate(self._layers):
            x = _rms_norm(h, layer.ln1.weight, layer.ln1.variance_epsilon)
            qkv = _linear(x, layer.qkv, layer.qkv_bias, "none", [None], "")
            q, k, v = qkv.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
            q = q.view(rows, q_len, -1, layer.head_dim)
            k = k.view(rows, q_len, -1, layer.head_dim)
            if layer.q_norm is not None:
                q = layer.q_norm(q)
            if layer.k_norm is not None:
                k = layer.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = v.view(rows, q_len, -1, layer.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            keys, values = cache.layers[index].update(k, v)
            out = torch.nn.functional.scaled_dot_product_attention(
                q,
                keys,
                values,
                attn_mask=allowed,
                scale=layer.scaling,
                enable_gqa=q.shape[1] != keys.shape[1],
            )
            out = out.transpose(1, 2).reshape(rows, q_len, -1)
            h = _linear_binary(out, h, layer.o, layer._o.bias, "add")
            x = _rms_norm(h, layer.ln2.weight, layer.ln2.variance_epsilon)
            gate = _linear(x, layer.gate, layer._g.bias, "swish", [None], "")
            act = _linear_binary(x, gate, layer.up, layer._u.bias, "mul")
            h = _linear_binary(act, h, layer.down, layer._d.bias, "add")
        last = h[:, -1]
        return _rms_norm(last, self._norm.weight, self._norm.variance_epsilon)


def fused_decoder(model: Any, rows: int = 16, name: str = "the model") -> FusedDecoder | None:
    """A ``FusedDecoder`` for ``model`` when it computes the model's own decoder, else ``None``."""
    config = model.config.get_text_config(decoder=True)
    weight = model.get_input_embeddings().weight
    reason = None
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        reason = f"model type {config.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    elif weight.device.type != "cpu" or weight.dtype != torch.float32:
        reason = f"it is {weight.dtype} on {weight.device.type} (the fused layers are for float32 on CPU)"
    elif getattr(config, "hidden_act", None) != "silu":
        reason = f"its activation is {getattr(config, 'hidden_act', None)!r}, not silu"
    elif not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        reason = "this torch build has no oneDNN linear kernels"
    elif getattr(model.config, "_attn_implementation", "sdpa") == "eager" and getattr(
        config, "attention_dropout", 0.0
    ):
        reason = "its attention has dropout"
    decoder = None
    if reason is None:
        try:
            decoder = FusedDecoder(model, rows)
            error = _probe_error(model, decoder)
        except (AttributeError, RuntimeError, TypeError, ValueError) as e:
            error, reason = (
                float("inf"),
                f"its layers do not have the expected form ({type(e).__name__}: {e})",
            )
        if reason is None and error > _PROBE_TOL:
            reason = f"its decoder does more than the fused layers (probe: relative difference {error:.1e})"
    if reason is not None:
        logger.info("decode loop: %s's own decoder forward runs: %s", name, reason)
        return None
    logger.info("decode loop: fused, prepacked oneDNN decoder layers (%s)", name)
    return decoder


def _probe_error(model: Any, decoder: FusedDecoder) -> float:
    """Largest difference between the model's last hidden state and ``decoder``'s on a probe:
    a prefill of two rows (one left-padded) followed by one decode step."""
    num_layers = len(decoder._layers)
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.arange(1, 10).remainder(vocab)
    with torch.inference_mode():
        reference = model.get_decoder()(input_ids=ids.unsqueeze(0), use_cache=False).last_hidden_state[0]
        cache = BatchKVCache(num_layers)
        q = torch.arange(8)
        causal = (q.unsqueeze(0) <= q.unsqueeze(1))[None, None]
        first = decoder(ids[:8].unsqueeze(0), q.unsqueeze(0), causal, cache)
        step = decoder(
            ids[8:].unsqueeze(0), torch.tensor([[8]]), torch.ones(1, 1, 1, 9, dtype=torch.bool), cache
        )
    ours = torch.stack([first[0], step[0]])
    wanted = reference[[7, 8]]
    return ((ours - wanted).abs().max() / wanted.abs().max().clamp(min=1e-6)).item()

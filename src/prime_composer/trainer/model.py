"""The trainer's model: device and process group, loading with ``from_pretrained``, FSDP2 sharding.

Typical use (one process, or every rank under ``torchrun``)::

    world = init_distributed()
    model, tokenizer = load_model(cfg.model, torch.device("cpu"))   # full weights on CPU ...
    model = shard_model(model, world, mixed_precision=False)        # ... then shards to world.device
    ...
    state_dict = full_state_dict(model)                             # whole weights on rank 0

Sharding follows FSDP2 practice (torchtitan): ``fully_shard`` on every decoder layer, so only one
layer's full parameters exist at a time during forward/backward, then on the root for what is left
(embeddings, final norm, output head; a tied output head stays one parameter in the root group).
Decoder layers are found by the model's own ``_no_split_modules`` class names, which transformers
declares for every architecture, instead of guessing attribute paths.

HSDP (``replicate > 1``): the same ``fully_shard`` calls on a 2-D mesh ``(replicate, shard)``, ranks
laid out row by row (ranks ``0 .. shard - 1`` hold the first copy), as torchtitan builds its
``dp_replicate x dp_shard`` mesh. FSDP2 then all-gathers and reduce-scatters within a row and
all-reduces the gradient shards down each column; the parameters are DTensors placed
``(Replicate(), Shard(0))``. Nothing else in the trainer names the mesh: every rank still gets its
own micro-batches, so the loss normalizers, metrics and checks all-reduce over every rank as with
FSDP; FSDP2 divides the gradients by the number of ranks in both layouts (the ``world_size`` factor
of ``train_step`` undoes it); the gradient norm, ``full_state_dict`` and the DCP checkpoints go
through the DTensors, which know their mesh (DCP writes a replicated shard once).

Every rank loads the whole checkpoint on CPU before sharding. That is simple and correct; for
models too big for one host's memory, loading on the ``meta`` device and broadcasting shards from
rank 0 would be the next step.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from prime_composer.config.base import ModelConfig
from prime_composer.model.resolve import resolve_model_name

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTN_IMPLEMENTATION = "sdpa"
"""Attention kernel for training: fused, available on CPU and GPU, and separates packed samples."""


@dataclass(frozen=True)
class World:
    """This process's place in the data-parallel group."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes shared files (metrics, final weights)."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """More than one rank, so collectives and sharding are needed."""
        return self.world_size > 1

    def barrier(self) -> None:
        """Wait for every rank; a no-op on a single process."""
        if dist.is_available() and dist.is_initialized():
            dist.barrier()


def get_device(local_rank: int | None = None) -> torch.device:
    """``cuda:<local_rank>`` when a GPU is visible, else ``cpu``.

    ``local_rank`` defaults to ``$LOCAL_RANK`` (set by torchrun), else 0.
    """
    if torch.cuda.is_available():
        if local_rank is None:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed() -> World:
    """Join the process group that torchrun describes in the environment, or run alone.

    Without ``RANK``/``WORLD_SIZE`` in the environment this is a single process and no process
    group is created (``World(0, 1, 0, device)``). Under torchrun the backend is NCCL for CUDA
    tensors plus gloo for CPU tensors when a GPU is visible, and gloo alone otherwise (CPU runs
    and tests). Calling it again returns the same world.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return World(rank=0, world_size=1, local_rank=0, device=get_device(0))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = get_device(local_rank)
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
            # gloo alongside NCCL: object collectives and CPU-offloaded state dicts stay on CPU.
            backend = "cpu:gloo,cuda:nccl" if dist.is_nccl_available() else "gloo"
        else:
            backend = "gloo"
        dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
    return World(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=device)


def close_distributed() -> None:
    """Leave the process group, once every rank has reached this point; a no-op without one.

    The barrier comes first: a gloo rank that destroyed its group while a peer still ran its last
    collective (an export, a checkpoint load) aborted at exit ("terminate called without an active
    exception"), failing a run or test that had finished.
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on a GPU and float32 on a CPU (as ``model.dtype`` documents)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def load_model(cfg: ModelConfig, device: torch.device) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from ``cfg.name`` (hub id, local directory, ``builtin:...``), in train
    mode on ``device`` with ``sdpa`` attention.

    ``cfg.dtype = "auto"`` picks the dtype for ``device`` (bfloat16 on a GPU, float32 on a CPU).
    A model loaded from ``cfg.gguf_file`` is dequantized by transformers; its leftover
    quantization config is dropped so that it trains and saves like a dense model.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_name(cfg.name)
    kwargs: dict[str, Any] = {"trust_remote_code": cfg.trust_remote_code}
    if cfg.revision is not None:
        kwargs["revision"] = cfg.revision
    if cfg.gguf_file is not None:
        kwargs["gguf_file"] = cfg.gguf_file
    dtype = resolve_dtype(cfg.dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    model_kwargs: dict[str, Any] = {}
    if cfg.gguf_file is not None:
        from transformers import GgufConfig

        # Training needs dense weights: without this, transformers keeps GGUF blocks packed when
        # a matmul kernel for them is installed.
        model_kwargs["quantization_config"] = GgufConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION, **kwargs, **model_kwargs
    )
    if cfg.gguf_file is not None:
        _drop_gguf_quantization(model)
    model.to(device)  # type: ignore[arg-type]  # transformers' typing of .to is too narrow
    model.train()
    logger.info("loaded %s (%s, %s) on %s", cfg.name, type(model).__name__, dtype, device)
    return model, tokenizer


def _drop_gguf_quantization(model: Any) -> None:
    """GGUF weights are dequantized at load time, but transformers keeps a quantizer that makes
    ``save_pretrained`` refuse the model; the tensors are dense, so forget it."""
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: modules whose class is in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"cannot find the decoder layers of {type(model).__name__} to shard: it declares no "
            f"_no_split_modules matching any submodule ({sorted(names)}); run it with 1 rank"
        )
    return layers


def shard_model(model: nn.Module, world: World, mixed_precision: bool, replicate: int = 1) -> nn.Module:
    """Shard ``model`` with FSDP2 over all ranks (per decoder layer, then the root) and move it to
    ``world.device``; with one rank it is only moved. ``replicate > 1``: HSDP, ``replicate`` copies
    each sharded over ``world_size / replicate`` consecutive ranks (``device_mesh``).

    ``mixed_precision`` computes in bfloat16 and reduces gradients in float32 while the optimizer
    keeps the parameters in their stored dtype (load them in float32 for that). It needs FSDP, so
    on one rank it is ignored with a warning: load the model in bfloat16 there instead.
    """
    if not world.is_distributed:
        if mixed_precision:
            logger.warning(
                "mixed_precision is ignored on a single rank (it is an FSDP2 setting); parameters "
                "stay %s. Set model.dtype = 'bfloat16' to train in bfloat16 on one rank.",
                next(model.parameters()).dtype,
            )
        return model.to(world.device)

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mixed_precision and next(model.parameters()).dtype != torch.float32:
        logger.warning(
            "mixed_precision with %s parameters: load them in float32 to keep fp32 master weights",
            next(model.parameters()).dtype,
        )
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else MixedPrecisionPolicy()
    )
    # fully_shard moves each module's shards (and buffers) to the mesh's device, so CPU-loaded full
    # weights never all sit on the GPU at once.
    mesh = device_mesh(world, replicate)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def device_mesh(world: World, replicate: int = 1) -> Any:
    """The trainer's ``DeviceMesh``: 1-D over every rank (FSDP2), or ``(replicate, shard)`` named
    ``("replicate", "shard")`` (HSDP). Collective: every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh

    if world.world_size % replicate:
        raise ValueError(
            f"trainer.parallel.replicate = {replicate} does not divide the {world.world_size} ranks this "
            "trainer runs with: make trainer.num_ranks a multiple of it"
        )
    if replicate == 1:
        return init_device_mesh(world.device.type, (world.world_size,))
    shape = (replicate, world.world_size // replicate)
    return init_device_mesh(world.device.type, shape, mesh_dim_names=("replicate", "shard"))


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole, unsharded weights as CPU tensors under Hugging Face keys, on rank 0.

    Collective under FSDP: every rank must call it; ranks other than 0 get ``{}``. On a single
    process the tensors are CPU copies, never aliases of the live parameters, so holding on to
    the result (e.g. as a frozen reference policy) is safe. Tied weights appear under both keys.
    """
    if dist.is_available() and dist.is_initialized() and _is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return cast(dict[str, torch.Tensor], state)
    return {key: tensor.detach().to("cpu", copy=True) for key, tensor in model.state_dict().items()}


def _is_sharded(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())

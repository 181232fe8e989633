"""The packed micro-batch the orchestrator hands to a trainer rank, and its byte format.

A ``MicroBatch`` has a **core** that every step needs — ``[R, T]`` tensors (rows x packed sequence
length) aligned with ``input_ids``: the value at ``t`` describes token ``t`` (its advantage, the
logprob the inference server sampled it with, whether it is trained on) — and **groups**:
term-specific tensors (``SDPOGroup``'s teacher rows, later DPO pairs) that only the loss term
using them reads. A group is a dataclass subclass of ``BatchGroup`` with a wire name, the dtypes
of its tensors and its own validation; registering it (``@register_group``) is all the byte
format needs to carry it. A micro-batch without a group's data simply has no entry for it.

No step-level counts travel with the batch: the trainer computes every global normalizer (loss
tokens, sequences, SDPO tokens) from the masks themselves, all-reduced over ranks, so there is
one source of truth for each denominator (``trainer/losses/aggregate.py``).

Bytes on the wire are a safetensors blob (tensors named ``<micro-batch>/<field>`` for the core and
``<micro-batch>/<group>/<field>`` for groups) whose header metadata holds, as JSON, the format
version, the step, the rank and per micro-batch its temperature and group names, plus a SHA-256
over that JSON, the tensor table and the tensor bytes (``prime_composer.integrity``). Decoding
checks the digest before it trusts a byte, so a truncated, zeroed or bit-flipped file is an error
naming what is wrong, never a silently different batch; nothing is unpickled, so a received batch
cannot run code.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Self, TypeVar

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from prime_composer.config.errors import DamagedInputError
from prime_composer.integrity import IntegrityError, bytes_digest

FORMAT_VERSION = 4

CORE_DTYPES: dict[str, torch.dtype] = {
    "input_ids": torch.long,
    "position_ids": torch.long,
    "loss_mask": torch.bool,
    "advantages": torch.float32,
    "inference_logprobs": torch.float32,
    "sample_ids": torch.long,
}
"""Name and dtype of every ``[R, T]`` core tensor of ``MicroBatch``."""


class BatchFormatError(DamagedInputError, ValueError):
    """A micro-batch (or its bytes) does not have the fields, shapes or dtypes the format requires."""


class BatchGroup:
    """Base of the term-specific tensor groups of a micro-batch (subclasses are dataclasses).

    Subclasses set ``name`` (the wire prefix and the key in ``MicroBatch.groups``) and ``dtypes``
    (field -> dtype, every field a tensor), and implement ``check`` for what the dtypes cannot say
    (shapes relative to the core, alignment rules).
    """

    name: ClassVar[str]
    dtypes: ClassVar[dict[str, torch.dtype]]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    def to(self, device: torch.device | str) -> Self:
        return replace(self, **{k: v.to(device) for k, v in self.tensors().items()})  # type: ignore[type-var]

    def validate(self, mb: MicroBatch) -> None:
        """Dtypes of every field, then the subclass's ``check``; errors name ``<group>.<field>``."""
        for name, dtype in self.dtypes.items():
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) or value.dtype != dtype:
                got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
                raise BatchFormatError(
                    f"MicroBatch group field {self.name}.{name} must be {dtype}, got {got}"
                )
        self.check(mb)

    def check(self, mb: MicroBatch) -> None:
        """Shape and consistency rules of the group relative to the core of ``mb``."""


GROUPS: dict[str, type[BatchGroup]] = {}
"""Every group the byte format knows, by wire name (filled by ``register_group``)."""

G = TypeVar("G", bound=BatchGroup)


def register_group(cls: type[G]) -> type[G]:
    """Class decorator: make a ``BatchGroup`` subclass known to the byte format."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} must be a dataclass to be a batch group")
    names = {f.name for f in dataclasses.fields(cls)}
    if names != set(cls.dtypes):
        raise TypeError(f"{cls.__name__}.dtypes must name exactly its fields {sorted(names)}")
    if cls.name in GROUPS and GROUPS[cls.name] is not cls:
        raise TypeError(f"batch group name {cls.name!r} is already taken by {GROUPS[cls.name].__name__}")
    GROUPS[cls.name] = cls
    return cls


@dataclass
class MicroBatch:
    """One forward/backward unit for one trainer rank. Core shapes ``[R, T]``."""

    input_ids: torch.Tensor
    """Token ids of the packed samples; padding uses the tokenizer's pad id."""
    position_ids: torch.Tensor
    """Position of each token within its own sample (restarts at 0 for every packed sample);
    a padding run is numbered 0, 1, ... like one more sample."""
    loss_mask: torch.Tensor
    """True only on tokens the policy generated (``Sample.completion_mask == 1``)."""
    advantages: torch.Tensor
    """The sample's advantage on each of its loss tokens, 0 elsewhere."""
    inference_logprobs: torch.Tensor
    """Logprob the inference server sampled each completion token with; 0 on prompt, tool and
    padding tokens."""
    sample_ids: torch.Tensor
    """Index of the token's sample, unique within the step; -1 on padding."""
    temperature: float = 1.0
    """Sampling temperature the completions were generated with; the trainer divides its logits
    by it so its logprobs are comparable with ``inference_logprobs``."""
    groups: dict[str, BatchGroup] = field(default_factory=dict)
    """Term-specific tensors by group name (e.g. ``"sdpo"``); absent = no data for that term here."""

    def __post_init__(self) -> None:
        shape = self.input_ids.shape
        if len(shape) != 2:
            raise BatchFormatError(f"MicroBatch.input_ids must be [R, T], got shape {tuple(shape)}")
        for name, dtype in CORE_DTYPES.items():
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) or value.shape != shape or value.dtype != dtype:
                got = (value.dtype, tuple(value.shape)) if isinstance(value, torch.Tensor) else type(value)
                raise BatchFormatError(
                    f"MicroBatch.{name} must be {dtype} of shape {tuple(shape)}, got {got}"
                )
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise BatchFormatError(f"MicroBatch.temperature must be finite and > 0, got {self.temperature}")
        if bool((self.loss_mask & (self.position_ids == 0)).any()):
            raise BatchFormatError(
                "MicroBatch.loss_mask marks the first token of a sample, which nothing predicts"
            )
        for name in ("advantages", "inference_logprobs"):
            if not bool(torch.isfinite(getattr(self, name)).all()):
                raise BatchFormatError(f"MicroBatch.{name} holds non-finite values")
        for key, group in self.groups.items():
            if key not in known_groups() or not isinstance(group, GROUPS[key]):
                raise BatchFormatError(f"MicroBatch.groups[{key!r}] is not a registered batch group")
            group.validate(self)

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def group(self, kind: type[G]) -> G | None:
        """This micro-batch's ``kind`` group, or None when it carries none."""
        found = self.groups.get(kind.name)
        return found if isinstance(found, kind) else None

    def core_tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in CORE_DTYPES}

    def to(self, device: torch.device | str) -> MicroBatch:
        moved: dict[str, Any] = {k: v.to(device) for k, v in self.core_tensors().items()}
        return replace(self, **moved, groups={k: g.to(device) for k, g in self.groups.items()})


# ------------------------------------------------------------------------------------ bytes

_META_KEY = "prime_composer"
_DIGEST_KEY = "prime_composer_sha256"


def encode_rank_batch(step: int, rank: int, micro_batches: list[MicroBatch]) -> bytes:
    """Serialize one rank's micro-batches of one step to bytes (safetensors + JSON header + digest)."""
    tensors: dict[str, torch.Tensor] = {}
    meta = []
    for i, mb in enumerate(micro_batches):
        tensors.update({f"{i}/{name}": t for name, t in mb.core_tensors().items()})
        for group_name, group in mb.groups.items():
            tensors.update({f"{i}/{group_name}/{name}": t for name, t in group.tensors().items()})
        meta.append({"temperature": mb.temperature, "groups": sorted(mb.groups)})
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    header_json = json.dumps({"format": FORMAT_VERSION, "step": step, "rank": rank, "meta": meta})
    blob = save_safetensors(tensors, metadata={_META_KEY: header_json})
    table, data = _split(blob)
    digest = bytes_digest(header_json.encode(), _canonical_table(table), data)
    table["__metadata__"][_DIGEST_KEY] = digest
    header = json.dumps(table, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # safetensors aligns the data section to 8 bytes
    return len(header).to_bytes(8, "little") + header + data


def decode_rank_batch(data: bytes) -> tuple[int, int, list[MicroBatch]]:
    """Inverse of ``encode_rank_batch``: returns ``(step, rank, micro_batches)``.

    Raises ``IntegrityError`` when the bytes do not match their digest (truncated, corrupted) and
    ``BatchFormatError`` when they hold another format version or a field is missing or wrong.
    """
    try:
        table, body = _split(data)
        metadata = table["__metadata__"]
        header_json, digest = metadata[_META_KEY], metadata.pop(_DIGEST_KEY)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise IntegrityError(f"not a prime-composer batch, or its header is damaged ({e})") from None
    if bytes_digest(header_json.encode(), _canonical_table(table), body) != digest:
        raise IntegrityError(
            "batch contents differ from the digest written with them (truncated or corrupted)"
        )
    header = json.loads(header_json)
    if header.get("format") != FORMAT_VERSION:
        raise BatchFormatError(
            f"batch format {header.get('format')} is not {FORMAT_VERSION}: orchestrator and trainer run "
            "different prime-composer versions (old rollout files cannot be trained on; regenerate them)"
        )
    tensors = load_safetensors(data)
    micro_batches = []
    for i, meta in enumerate(header["meta"]):
        core = {name: _tensor(tensors, f"{i}/{name}", name, i) for name in CORE_DTYPES}
        groups: dict[str, BatchGroup] = {}
        for group_name in meta["groups"]:
            kind = known_groups().get(group_name)
            if kind is None:
                raise BatchFormatError(
                    f"micro-batch {i} carries a group {group_name!r} this trainer does not know "
                    f"(known: {sorted(GROUPS)}); orchestrator and trainer run different versions"
                )
            values = {
                name: _tensor(tensors, f"{i}/{group_name}/{name}", f"{group_name}.{name}", i)
                for name in kind.dtypes
            }
            groups[group_name] = kind(**values)
        micro_batches.append(MicroBatch(**core, temperature=meta["temperature"], groups=groups))
    return header["step"], header["rank"], micro_batches


def _tensor(tensors: dict[str, torch.Tensor], key: str, field_name: str, index: int) -> torch.Tensor:
    if key not in tensors:
        raise BatchFormatError(f"micro-batch {index} has no tensor for field {field_name!r}")
    return tensors[key]


def _split(blob: bytes) -> tuple[dict[str, Any], memoryview]:
    """The parsed safetensors header (tensor table + ``__metadata__``) and the data section."""
    header_len = int.from_bytes(blob[:8], "little")
    if len(blob) < 8 or header_len > len(blob) - 8:
        raise ValueError(f"header length {header_len} exceeds the {len(blob)} bytes")
    table = json.loads(blob[8 : 8 + header_len])
    if not isinstance(table, dict):
        raise ValueError("the header is not a JSON object")
    return table, memoryview(blob)[8 + header_len :]


def _canonical_table(table: dict[str, Any]) -> bytes:
    """The tensor table (names, dtypes, shapes, offsets) in a canonical byte form, for the digest."""
    return json.dumps({k: v for k, v in table.items() if k != "__metadata__"}, sort_keys=True).encode()


def known_groups() -> dict[str, type[BatchGroup]]:
    """``GROUPS`` with the built-in groups (``transport/groups.py``) imported: they register
    themselves on import, and checking or decoding needs them all."""
    importlib.import_module("prime_composer.transport.groups")
    return GROUPS

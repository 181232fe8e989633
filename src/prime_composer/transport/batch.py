"""The packed micro-batch the orchestrator hands to a trainer rank, and its byte format.

Every tensor is ``[R, T]`` (rows x packed sequence length) and aligned with ``input_ids``: the
value at ``t`` describes token ``t`` (its advantage, the logprob the inference server sampled it
with, whether it is trained on). The trainer does the shift to next-token prediction.

The step-level counts (``num_loss_tokens``, ``num_samples``, ``max_completion_len``,
``num_sdpo_tokens``) are global over all ranks and micro-batches of the step, so each rank can
normalise its partial loss sum by the same denominator and the gradient does not depend on how the
step was split.

SDPO: ``sdpo_mask`` marks, on the student rows, the target-turn tokens of hinted samples; the
teacher rows ``teacher_*`` (``[Rt, T]``, ``Rt = 0`` when nothing in the micro-batch is hinted) hold
each hinted sample's teacher sequence (hinted prefix + the same target tokens), with
``teacher_target_mask`` on those tokens. Alignment rule: the k-th True of ``sdpo_mask`` (row-major)
is the same token as the k-th True of ``teacher_target_mask``.

Bytes on the wire are a safetensors blob (tensors named ``<micro-batch index>/<field>``) whose
header metadata holds the step, the rank and the counts as JSON: nothing is unpickled, so a
received batch cannot run code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

FORMAT_VERSION = 3

TENSOR_DTYPES: dict[str, torch.dtype] = {
    "input_ids": torch.long,
    "position_ids": torch.long,
    "loss_mask": torch.bool,
    "advantages": torch.float32,
    "inference_logprobs": torch.float32,
    "sample_ids": torch.long,
    "sdpo_mask": torch.bool,
}
"""Name and dtype of every ``[R, T]`` tensor field of ``MicroBatch``."""

TEACHER_DTYPES: dict[str, torch.dtype] = {
    "teacher_input_ids": torch.long,
    "teacher_position_ids": torch.long,
    "teacher_target_mask": torch.bool,
}
"""Name and dtype of every ``[Rt, T]`` teacher tensor field of ``MicroBatch`` (SDPO)."""

STEP_FIELDS = ("num_loss_tokens", "num_samples", "max_completion_len", "temperature", "num_sdpo_tokens")
"""Step-level metadata every micro-batch carries (global over all ranks and micro-batches)."""


@dataclass
class MicroBatch:
    """One forward/backward unit for one trainer rank. Shapes ``[R, T]``."""

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
    num_loss_tokens: int
    """Loss tokens in the whole step (all ranks, all micro-batches)."""
    num_samples: int
    """Samples in the whole step."""
    max_completion_len: int
    """Longest completion (tokens after the prompt, after truncation) in the whole step."""
    temperature: float = 1.0
    """Sampling temperature the completions were generated with; the trainer divides its logits
    by it so its logprobs are comparable with ``inference_logprobs``."""
    sdpo_mask: torch.Tensor | None = None
    """SDPO target tokens of hinted samples (a subset of ``loss_mask``); None means none."""
    teacher_input_ids: torch.Tensor | None = None
    """``[Rt, T]`` packed teacher sequences: hinted prefix + the same target tokens; None means
    ``Rt = 0``."""
    teacher_position_ids: torch.Tensor | None = None
    """``[Rt, T]`` positions of the teacher rows, restarting at 0 for every packed sequence."""
    teacher_target_mask: torch.Tensor | None = None
    """``[Rt, T]`` True on the teacher's copies of the ``sdpo_mask`` tokens, in the same order."""
    num_sdpo_tokens: int = 0
    """SDPO target tokens in the whole step (all ranks, all micro-batches)."""

    def __post_init__(self) -> None:
        shape = self.input_ids.shape
        if len(shape) != 2:
            raise ValueError(f"MicroBatch.input_ids must be [R, T], got shape {tuple(shape)}")
        if self.sdpo_mask is None:
            self.sdpo_mask = torch.zeros(shape, dtype=torch.bool)
        for name, dtype in TEACHER_DTYPES.items():
            if getattr(self, name) is None:
                setattr(self, name, torch.zeros((0, shape[1]), dtype=dtype))
        for name, dtype in TENSOR_DTYPES.items():
            value = getattr(self, name)
            if value.shape != shape or value.dtype != dtype:
                raise ValueError(
                    f"MicroBatch.{name} must be {dtype} of shape {tuple(shape)}, "
                    f"got {value.dtype} of shape {tuple(value.shape)}"
                )
        teacher_shape = self.teacher_input_ids.shape  # type: ignore[union-attr]
        for name, dtype in TEACHER_DTYPES.items():
            value = getattr(self, name)
            if len(teacher_shape) != 2 or value.shape != teacher_shape or value.dtype != dtype:
                raise ValueError(
                    f"MicroBatch.{name} must be {dtype} of shape [Rt, T] like teacher_input_ids "
                    f"{tuple(teacher_shape)}, got {value.dtype} of shape {tuple(value.shape)}"
                )
        num_student = int(self.sdpo_mask.sum())  # type: ignore[union-attr]
        num_teacher = int(self.teacher_target_mask.sum())  # type: ignore[union-attr]
        if num_student != num_teacher:
            raise ValueError(
                f"MicroBatch: sdpo_mask has {num_student} tokens but teacher_target_mask has {num_teacher}; "
                "they must align one to one"
            )

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in (*TENSOR_DTYPES, *TEACHER_DTYPES)}

    def step_meta(self) -> dict[str, int | float]:
        return {name: getattr(self, name) for name in STEP_FIELDS}

    def to(self, device: torch.device | str) -> MicroBatch:
        moved: dict[str, Any] = {k: v.to(device) for k, v in self.tensors().items()}
        return replace(self, **moved)


# Every dataclass field is either a tensor or step metadata; a new field must be added to one of them.
assert {f.name for f in fields(MicroBatch)} == set(TENSOR_DTYPES) | set(TEACHER_DTYPES) | set(STEP_FIELDS)


def encode_rank_batch(step: int, rank: int, micro_batches: list[MicroBatch]) -> bytes:
    """Serialize one rank's micro-batches of one step to bytes (safetensors + JSON header)."""
    tensors = {
        f"{i}/{name}": value.detach().cpu().contiguous()
        for i, mb in enumerate(micro_batches)
        for name, value in mb.tensors().items()
    }
    header = {
        "format": FORMAT_VERSION,
        "step": step,
        "rank": rank,
        "meta": [mb.step_meta() for mb in micro_batches],
    }
    return save_safetensors(tensors, metadata={"prime_composer": json.dumps(header)})


def decode_rank_batch(data: bytes) -> tuple[int, int, list[MicroBatch]]:
    """Inverse of ``encode_rank_batch``: returns ``(step, rank, micro_batches)``."""
    tensors = load_safetensors(data)
    header = json.loads(_safetensors_metadata(data)["prime_composer"])
    if header["format"] != FORMAT_VERSION:
        raise ValueError(
            f"batch format {header['format']} is not {FORMAT_VERSION}: orchestrator and trainer "
            "run different prime-composer versions"
        )
    micro_batches = []
    for i, meta in enumerate(header["meta"]):
        values: dict[str, Any] = {name: tensors[f"{i}/{name}"] for name in (*TENSOR_DTYPES, *TEACHER_DTYPES)}
        micro_batches.append(MicroBatch(**values, **meta))
    return header["step"], header["rank"], micro_batches


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    # The safetensors layout: 8-byte little-endian header length, then a JSON header whose
    # "__metadata__" entry holds the string metadata given to save().
    header_len = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + header_len])["__metadata__"]

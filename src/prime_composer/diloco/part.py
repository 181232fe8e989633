"""The ``diloco`` checkpoint part, as both outer-loop backends write it.

``checkpoints/step_<N>/diloco/`` holds ``state.safetensors`` (every tensor of the loop's state),
``meta.json`` (its plain values and the step) and ``MANIFEST.json`` (digests). It goes through the
one writer of every part, ``checkpoint_layout.StepCheckpoints.write_part``: written to a temporary
directory, renamed into place, marked complete with ``diloco.STABLE``, so a crash mid-save leaves no
part that resume would load, and a save that fails (a full disk) removes its partial files and
raises ``CheckpointWriteError`` naming the newest complete step. The step itself is committed by
the trainer once this part is there (``CheckpointManager.commit``). ``read_part`` verifies the
manifest first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from prime_composer.checkpoint_layout import StepCheckpoints, step_dir
from prime_composer.integrity import verify_manifest
from prime_composer.io import atomic_write_text

CHECKPOINT_PART = "diloco"
_STATE_FILE = "state.safetensors"
_META_FILE = "meta.json"


def write_part(root: Path, step: int, state: dict[str, Any]) -> Path:
    """Write ``state`` (tensors and JSON values) as the ``diloco`` part of checkpoint ``step``."""
    tensors = {k: v.contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}
    meta = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}

    def write(tmp: Path) -> None:
        try:
            save_file(tensors, str(tmp / _STATE_FILE))
        except SafetensorError as e:  # its I/O errors (no space left) are not OSErrors
            raise OSError(f"{tmp / _STATE_FILE}: {e}") from e
        atomic_write_text(tmp / _META_FILE, json.dumps({"step": step, **meta}, indent=1) + "\n")

    # keep is unused without commit: pruning is the trainer's, with ckpt.keep.
    steps = StepCheckpoints(root, keep=1, parts=(CHECKPOINT_PART,))
    return steps.write_part(step, CHECKPOINT_PART, write, commit=False)


def read_part(root: Path, step: int) -> dict[str, Any]:
    """The state ``write_part`` wrote for checkpoint ``step``, verified against its manifest."""
    directory = step_dir(root, step) / CHECKPOINT_PART
    verify_manifest(directory)
    meta: dict[str, Any] = json.loads((directory / _META_FILE).read_text())
    return meta | load_file(str(directory / _STATE_FILE))

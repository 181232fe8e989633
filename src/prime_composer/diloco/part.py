"""The ``diloco`` checkpoint part, as both outer-loop backends write it.

``checkpoints/step_<N>/diloco/`` holds ``state.safetensors`` (every tensor of the loop's state),
``meta.json`` (its plain values and the step) and ``MANIFEST.json`` (digests); it is written to a
temporary directory, renamed into place, and marked complete with ``diloco.STABLE``, so a crash
mid-save leaves no part that resume would load. ``read_part`` verifies the manifest first.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from prime_composer.checkpoint_layout import marker_path, step_dir
from prime_composer.integrity import verify_manifest, write_manifest
from prime_composer.io import atomic_write_text

CHECKPOINT_PART = "diloco"
_STATE_FILE = "state.safetensors"
_META_FILE = "meta.json"


def write_part(root: Path, step: int, state: dict[str, Any]) -> Path:
    """Write ``state`` (tensors and JSON values) as the ``diloco`` part of checkpoint ``step``."""
    tensors = {k: v.contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}
    meta = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
    final = step_dir(root, step) / CHECKPOINT_PART
    tmp = step_dir(root, step) / f".{CHECKPOINT_PART}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / _STATE_FILE))
    atomic_write_text(tmp / _META_FILE, json.dumps({"step": step, **meta}, indent=1) + "\n")
    write_manifest(tmp)
    marker = marker_path(root, step, CHECKPOINT_PART)
    marker.unlink(missing_ok=True)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    atomic_write_text(marker, json.dumps({"step": step, "part": CHECKPOINT_PART}) + "\n")
    return final


def read_part(root: Path, step: int) -> dict[str, Any]:
    """The state ``write_part`` wrote for checkpoint ``step``, verified against its manifest."""
    directory = step_dir(root, step) / CHECKPOINT_PART
    verify_manifest(directory)
    meta: dict[str, Any] = json.loads((directory / _META_FILE).read_text())
    return meta | load_file(str(directory / _STATE_FILE))

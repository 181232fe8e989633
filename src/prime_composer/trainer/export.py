"""Write the trained model as a complete Hugging Face directory (weights, config, tokenizer).

The result loads with ``from_pretrained`` and as ``model.name`` everywhere (trainer, both inference
backends, the teacher), unlike ``transport/weights.py``'s published steps, which carry no
tokenizer and are meant for live weight updates. Written into a hidden temporary directory and
renamed into place, so a reader never sees half a model.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from torch import nn

from prime_composer.integrity import write_manifest
from prime_composer.trainer.model import World, full_state_dict

logger = logging.getLogger(__name__)


def save_hf_directory(model: Any, tokenizer: Any, path: Path, world: World) -> Path:
    """Save ``model`` (sharded or not) and ``tokenizer`` to ``path``, replacing what is there.

    ``model`` is a transformers ``PreTrainedModel``. Collective under FSDP (every rank gathers
    its shards); only rank 0 writes.
    """
    path = Path(path)
    state_dict = full_state_dict(model)
    if world.is_main:
        _retie(model, state_dict)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}-", dir=path.parent))
        try:
            model.save_pretrained(tmp, state_dict=state_dict)
            tokenizer.save_pretrained(tmp)
            for entry in tmp.iterdir():
                if entry.is_file():
                    entry.chmod(0o644)  # readable by a server running as another user
                    with open(entry, "rb") as f:
                        os.fsync(f.fileno())
            tmp.chmod(0o755)  # mkdtemp makes it private
            # The next stage (RL after the warm-up) checks the files against it when it loads them.
            write_manifest(tmp).chmod(0o644)
            if path.exists():
                stale = Path(tempfile.mkdtemp(prefix=f".stale-{path.name}-", dir=path.parent))
                os.replace(path, stale / "old")
                shutil.rmtree(stale, ignore_errors=True)
            os.replace(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("saved the model and tokenizer to %s", path)
    world.barrier()
    return path


def _retie(model: nn.Module, state_dict: dict) -> None:
    """Make tied parameters share one tensor again in ``state_dict``.

    A gathered (or copied) state dict holds separate copies of, e.g., the input embedding and a
    tied output head; ``save_pretrained`` recognises ties by shared storage, so without this it
    would write the head twice.
    """
    names_by_param: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        names_by_param[id(param)].append(name)
    for names in names_by_param.values():
        present = [n for n in names if n in state_dict]
        for alias in present[1:]:
            state_dict[alias] = state_dict[present[0]]

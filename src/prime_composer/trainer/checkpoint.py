"""Trainer checkpoints that resume bit-exactly, written atomically, one part of a shared step dir.

Layout (the orchestrator and DiLoCo write their own parts next to the trainer's)::

    <root>/step_<N>/trainer/            this module's part
        model_optim/                    model + optimizer (+ extra ``states``, e.g. the SDPO teacher),
                                        torch.distributed.checkpoint (DCP) format
        scheduler.pt                    LR scheduler state (identical on every rank)
        rng/rank_<R>.pt                 python / numpy / torch (/ cuda) RNG states of rank R
        meta.json                       {"step", "world_size", "extra", "states", "model", ...}
    <root>/step_<N>/trainer.STABLE      "the trainer part of step N is written"
    <root>/step_<N>/orchestrator/ + orchestrator.STABLE, diloco/ + diloco.STABLE
    <root>/step_<N>/STABLE              "step N is complete": every part written and verified

Parts are published, committed and pruned through one manager, ``checkpoint_layout.StepCheckpoints``
(torch-free, so the orchestrator's part goes through it too): a step is resumable only once every
part of the run is written and verifies, and steps are deleted as units, so a full disk that stops
one part never leaves a step that holds the other parts only.

Atomicity: every rank writes into ``<root>/step_<N>/.trainer.tmp/``; after a barrier each rank
hashes the files it wrote (its DCP shards and RNG state; rank 0 the shared files too:
``file_owner``) and rank 0 writes ``MANIFEST.json`` from their digests (size and SHA-256 of every
file: ``prime_composer.integrity``), so hashing takes one rank's share of the time; it renames
the directory to ``trainer/``, writes ``trainer.STABLE`` and commits the step if the other parts
are there. A crash at any point leaves either no marker (never loaded) or a complete part.
Loading verifies the manifest first, each rank the files it owns (every rank raises if one is
bad), so a truncated, zeroed or missing file is an error naming it, never different weights. A save that fails (a full disk) removes its partial files and says
which checkpoint is still intact.

Why DCP for model and optimizer: each rank writes only its own FSDP2 shards, in parallel, with no
gather of the full model *and* its two AdamW moments into rank 0's memory (3x the model in fp32,
too much for a 32B model), and a checkpoint written by N ranks loads on M ranks (DCP reshards by
parameter name). It works unchanged on one process without a process group and on CPU with
gloo, where the tests run it. The small pieces (scheduler, RNG, metadata) are plain files.

Exact resume: parameters and AdamW moments are stored bit for bit, the scheduler's step count
restores the learning rate, and each rank's RNG states are restored, so N steps straight equal
k steps + save + load into fresh objects + N - k steps (``tests/unit/test_checkpoint.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from prime_composer.checkpoint_layout import (
    CheckpointWriteError,
    StepCheckpoints,
    all_steps,
    complete_steps,
    is_complete,
    latest_complete_step,
    marker_path,
    step_dir,
)
from prime_composer.integrity import (
    IntegrityError,
    file_entry,
    listed_files,
    read_manifest,
    verify_manifest,
    write_manifest_entries,
)
from prime_composer.io import atomic_write_text
from prime_composer.trainer.model import World

logger = logging.getLogger(__name__)

_FORMAT_VERSION = 1
MODEL_OPTIM_DIR = "model_optim"
SCHEDULER_FILE = "scheduler.pt"
META_FILE = "meta.json"
RNG_DIR = "rng"

__all__ = [
    "CheckpointManager",
    "CheckpointWriteError",
    "all_steps",
    "complete_steps",
    "is_complete",
    "latest_complete_step",
    "marker_path",
    "step_dir",
]


class CheckpointManager:
    """Saves and loads one part (default ``trainer``) of the step checkpoints under ``root``.

    ``save`` and ``load`` are collective under FSDP: every rank calls them with the same step.
    ``root`` must be a filesystem every rank sees (each rank writes its own shards). ``parts``: every
    part a step of the run has (``ckpt.parts``; default: this part alone), so that the step is
    committed only when all of them are written.
    """

    def __init__(
        self,
        root: Path,
        keep: int,
        world: World,
        part: str = "trainer",
        parts: tuple[str, ...] | None = None,
    ) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_-]+", part):
            raise ValueError(f"checkpoint part name {part!r} must be letters, digits, '_' or '-'")
        self.steps = StepCheckpoints(root, keep, tuple(dict.fromkeys((part, *(parts or ())))))
        self.root = Path(root)
        self.keep = keep
        self.world = world
        self.part = part

    # ------------------------------------------------------------------------------------- save

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        extra: dict[str, Any] | None = None,
        states: dict[str, Any] | None = None,
        model_name: str | None = None,
    ) -> Path:
        """Write this part of ``step`` and mark it complete; then drop all but the newest ``keep``.

        ``extra`` is saved as JSON (e.g. data position, counters) and returned by ``load``; it must
        be JSON-serializable. ``states`` are more objects saved with DCP next to model and optimizer
        (``Stateful``: ``state_dict()`` / ``load_state_dict()``, e.g. the SDPO teacher), by name; their
        names go into ``meta.json`` so ``load`` can say when one is missing. ``model_name``: what
        built ``model`` (``model.name``), recorded so that ``load`` refuses another. Returns the
        part's directory. Re-saving an existing step replaces it.
        """
        extra = dict(extra or {})
        states = _check_states(states)
        try:
            json.dumps(extra)
        except TypeError as e:
            raise ValueError(
                f"checkpoint extra must be JSON-serializable (numbers, strings, lists, dicts): {e}"
            ) from e

        started = time.perf_counter()
        tmp = self.steps.tmp_dir(step, self.part)
        try:
            self._write(tmp, step, model, optimizer, scheduler, extra, states, model_name)
            # Rank 0 publishes (rename, marker) and commits the step if the other parts are there.
            if self.world.is_main:
                self.steps.publish(step, self.part)
        except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
            # e.g. no space left on the device (torch.save reports it as a RuntimeError from its zip
            # writer, DCP wraps that in its own exception): leave no partial files, say what is intact.
            raise self.steps.failed(step, self.part, e) from e
        final = step_dir(self.root, step) / self.part
        if self.world.is_main:
            logger.info(
                "saved %s checkpoint of step %d in %.1fs: %s",
                self.part,
                step,
                time.perf_counter() - started,
                final,
            )
        self.world.barrier()
        return final

    def _write(
        self,
        tmp: Path,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        extra: dict[str, Any],
        states: dict[str, Any],
        model_name: str | None = None,
    ) -> None:
        """Every rank's files into ``tmp``, then (rank 0) the metadata and the manifest."""
        import torch.distributed.checkpoint as dcp

        if self.world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that crashed
            (tmp / RNG_DIR).mkdir(parents=True)
        self.world.barrier()
        with _quiet_single_process():
            dcp.save(
                _dcp_state(model, optimizer) | states,
                checkpoint_id=str(tmp / MODEL_OPTIM_DIR),
                no_dist=_no_dist(),
            )
        _save_file(_rng_state(), tmp / RNG_DIR / f"rank_{self.world.rank}.pt")
        if self.world.is_main:
            _save_file(scheduler.state_dict(), tmp / SCHEDULER_FILE)
            meta = {
                "format": _FORMAT_VERSION,
                "step": step,
                "part": self.part,
                "world_size": self.world.world_size,
                "torch": torch.__version__,
                "time": time.time(),
                "extra": extra,
                "states": sorted(states),
                "model": model_name,
            }
            atomic_write_text(tmp / META_FILE, json.dumps(meta, indent=2) + "\n")
        self.world.barrier()  # every rank's files are written (DCP fsyncs its own)
        started = time.perf_counter()
        write_sharded_manifest(tmp, self.world)
        if self.world.is_main:
            logger.info("checkpoint digests of step %d: %.2f s", step, time.perf_counter() - started)

    def commit(self, step: int) -> bool:
        """Commit ``step`` once a part written outside this manager is in place too (the DiLoCo part:
        ``OuterLoop.save``); collective. Returns whether the step is complete."""
        committed = self.steps.commit(step) if self.world.is_main else False
        self.world.barrier()
        return committed

    # ------------------------------------------------------------------------------------- load

    def resolve_step(self, step: int | None) -> int:
        """``step`` if its part is complete, or the newest complete step for ``None``.

        Raises ``ValueError`` naming the directory when there is nothing to load.
        """
        complete = complete_steps(self.root, (self.part,))
        if step is None:
            if not complete:
                raise ValueError(
                    f"no complete {self.part} checkpoint under {self.root} to resume from; run without "
                    "resume, or point the output directory at a run that saved checkpoints"
                )
            return complete[-1]
        if step not in complete:
            found = ", ".join(map(str, complete)) or "none"
            raise ValueError(
                f"no complete {self.part} checkpoint for step {step} under {self.root} "
                f"(complete steps: {found}); an incomplete checkpoint is never loaded"
            )
        return step

    def read_extra(self, step: int) -> dict[str, Any]:
        """The ``extra`` dict saved with this part of ``step`` (checked against the manifest), to
        decide whether to load it before reading any tensor."""
        directory = step_dir(self.root, self.resolve_step(step)) / self.part
        verify_manifest(directory, only=[META_FILE])
        return dict(json.loads((directory / META_FILE).read_text())["extra"])

    def load(
        self,
        step: int | None,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        states: dict[str, Any] | None = None,
        model_name: str | None = None,
    ) -> dict[str, Any]:
        """Restore model, optimizer, scheduler, ``states`` (by the names given to ``save``) and this
        rank's RNG from ``step`` (``None``: the newest complete one) and return the ``extra`` dict
        given to ``save``. A requested state the checkpoint lacks is a ``ValueError``, and so is a
        checkpoint of another architecture than ``model`` (``check_architecture``) or, with
        ``model_name`` (what built ``model``), one trained from another model name
        (``check_model_name``: a same-shaped model of another name passes the shape check).

        ``model`` and ``optimizer`` must be built (and sharded) the same way as when saving; the
        number of ranks may differ (DCP reshards). Use ``resolve_step`` to learn the step first.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        step = self.resolve_step(step)
        directory = step_dir(self.root, step) / self.part
        verify_sharded_manifest(directory, self.world)  # IntegrityError naming the damaged file, first
        meta = json.loads((directory / META_FILE).read_text())
        states = _check_states(states)
        missing = sorted(set(states) - set(meta.get("states", [])))
        if missing:
            raise ValueError(
                f"the {self.part} checkpoint of step {step} ({directory}) has no {missing} state: it was saved "
                "by a run configured without it (e.g. loss.sdpo.weight = 0 or loss.sdpo.teacher = 'live'); "
                "resume with the settings it was saved with"
            )
        check_architecture(directory, model, model_name)
        check_model_name(directory, meta, model_name)
        state = _dcp_state(model, optimizer) | states
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=str(directory / MODEL_OPTIM_DIR), no_dist=_no_dist())
        # Not strict: the frozen parameters are not in the checkpoint (every saved key was loaded,
        # dcp.load refuses a key the checkpoint lacks).
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
        scheduler.load_state_dict(torch.load(directory / SCHEDULER_FILE, weights_only=True))

        rng_file = directory / RNG_DIR / f"rank_{self.world.rank}.pt"
        if rng_file.is_file():
            _set_rng_state(torch.load(rng_file, weights_only=True))
        else:
            logger.warning(
                "checkpoint of step %d was written by %d ranks and has no RNG state for rank %d: "
                "its random streams start fresh, so the run is not bit-exact with an uninterrupted one",
                step,
                meta["world_size"],
                self.world.rank,
            )
        logger.info("loaded %s checkpoint of step %d from %s", self.part, step, directory)
        return meta["extra"]


_RANK_FILE = re.compile(r"(?:^|/)(?:__(\d+)_\d+\.distcp|rank_(\d+)\.pt)$")
"""The files one rank writes: its DCP shards (``__<rank>_<i>.distcp``) and its RNG state."""


def file_owner(name: str, world_size: int) -> int:
    """The rank that hashes (on save) and verifies (on load) the part's file ``name``: the rank
    that wrote it (a checkpoint of more ranks spreads the extra ones round robin), rank 0 for the
    shared files (DCP's ``.metadata``, the scheduler, ``meta.json``)."""
    m = _RANK_FILE.search(name)
    return int(m.group(1) or m.group(2)) % world_size if m else 0


def write_sharded_manifest(directory: Path, world: World) -> None:
    """``MANIFEST.json`` of ``directory`` with each rank hashing the files it owns (``file_owner``),
    in parallel; rank 0 gathers the digests and writes it. Collective; call it after a barrier
    that follows the last write."""
    names = listed_files(directory)
    own = {n: file_entry(directory / n) for n in names if file_owner(n, world.world_size) == world.rank}
    gathered = _gather_to_main(own, world)
    if world.is_main:
        files = {k: v for part in gathered for k, v in part.items()}
        missing = sorted(set(names) - set(files))
        assert not missing, f"no rank hashed {missing}"
        write_manifest_entries(directory, files)


def verify_sharded_manifest(directory: Path, world: World) -> None:
    """``verify_manifest`` with each rank checking the files it owns (``file_owner``); every rank
    raises the same ``IntegrityError`` (the first bad file's) if any is damaged. Collective."""
    problem = ""
    try:
        own = [n for n in sorted(read_manifest(directory)) if file_owner(n, world.world_size) == world.rank]
        verify_manifest(directory, only=own)
    except IntegrityError as e:
        problem = str(e)
    problems = [problem]
    if world.is_distributed and torch.distributed.is_initialized():
        problems = [""] * world.world_size
        torch.distributed.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first is not None:
        raise IntegrityError(first)


def _gather_to_main(obj: Any, world: World) -> list[Any]:
    """``obj`` of every rank, on rank 0 (others get an empty list)."""
    if not (world.is_distributed and torch.distributed.is_initialized()):
        return [obj]
    out: list[Any] | None = [None] * world.world_size if world.is_main else None
    torch.distributed.gather_object(obj, out, dst=0)
    return out or []


def check_architecture(part: Path, model: nn.Module, model_name: str | None = None) -> None:
    """Refuse a trainer checkpoint part whose model tensors differ from ``model``'s (names, shapes,
    dtypes): DCP alone would load a smaller model from a larger checkpoint silently (the extra
    layers dropped) and fail with a traceback the other way round. One-line ``ValueError`` naming
    both models (the checkpoint's from its ``meta.json``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(Path(part) / MODEL_OPTIM_DIR)).read_metadata()
    saved = {
        key.removeprefix("model."): entry
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)
    }
    expected = trained_model_state(model)
    problems = []
    if saved.keys() != expected.keys():
        layers_saved, layers_model = _num_layers(saved), _num_layers(expected)
        if layers_saved != layers_model:
            problems.append(f"{layers_saved} layers in the checkpoint, {layers_model} in the model")
        only_saved = sorted(saved.keys() - expected.keys())
        only_model = sorted(expected.keys() - saved.keys())
        if only_saved:
            problems.append(f"{len(only_saved)} tensors only in the checkpoint (e.g. {only_saved[0]})")
        if only_model:
            problems.append(f"{len(only_model)} tensors only in the model (e.g. {only_model[0]})")
    for name in sorted(saved.keys() & expected.keys()):
        shape, tensor = tuple(saved[name].size), expected[name]
        if shape != tuple(tensor.shape):
            problems.append(f"{name} is {list(shape)} in the checkpoint, {list(tensor.shape)} in the model")
            break
        if saved[name].properties.dtype != tensor.dtype:
            problems.append(
                f"{name} is {saved[name].properties.dtype} in the checkpoint, {tensor.dtype} in the model "
                "(model.dtype)"
            )
            break
    if not problems:
        return
    trained_from = "unknown"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        trained_from = repr(json.loads((Path(part) / META_FILE).read_text())["extra"]["model"]["name"])
    raise ValueError(
        f"the checkpoint {part} holds another model than model.name = {model_name!r} builds: "
        f"{'; '.join(problems)}. It was trained from {trained_from}: use that model (and dtype), or "
        "another checkpoint"
    )


def recorded_model_name(meta: dict[str, Any]) -> str | None:
    """The model a part's ``meta.json`` says it was trained from: ``save``'s ``model_name``, else
    the trainer's ``extra["model"]["name"]`` (checkpoints from before the manager recorded it);
    None when neither is there."""
    name = meta.get("model")
    if name is None:
        recorded = (meta.get("extra") or {}).get("model")
        name = recorded.get("name") if isinstance(recorded, dict) else None
    return name if isinstance(name, str) else None


def check_model_name(part: Path, meta: dict[str, Any], model_name: str | None) -> None:
    """Refuse to load ``part`` into a model built from another ``model.name`` than the one it was
    trained from (one-line ``ValueError`` naming both); nothing to check when either is unknown."""
    saved = recorded_model_name(meta)
    if model_name is None or saved is None or saved == model_name:
        return
    raise ValueError(
        f"the checkpoint {part} was trained from model.name = {saved!r}, but this run's model.name is "
        f"{model_name!r}: resume with the model it was trained from, or start a new run (another output_dir)"
    )


def _num_layers(names: Any) -> int:
    """Distinct ``layers.<i>.`` indices among parameter names (the decoder's depth)."""
    return len({m.group(1) for name in names if (m := re.search(r"layers\.(\d+)\.", name))})


def _check_states(states: dict[str, Any] | None) -> dict[str, Any]:
    states = dict(states or {})
    clash = sorted(set(states) & {"model", "optimizer"})
    if clash:
        raise ValueError(f"checkpoint states may not be named {clash}: those hold the model and optimizer")
    return states


def trained_model_state(model: nn.Module) -> dict[str, Any]:
    """The model's state for DCP without its frozen parameters (what a checkpoint holds)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
    # A frozen tied alias (a tied output head) survives ignore_frozen_params under its second name.
    for name, param in model.named_parameters(remove_duplicate=False):
        if not param.requires_grad:
            state.pop(name, None)
    return state


def _dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state keyed by parameter name (plain tensors, or DTensor shards).

    Frozen parameters are left out: they never change, so a LoRA run stores its adapter only (the
    run records which base it adapts); with full fine-tuning nothing is frozen."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return {
        "model": trained_model_state(model),
        # Names, not positions, key the optimizer state, so it survives resharding.
        "optimizer": get_optimizer_state_dict(model, optimizer),
    }


def _no_dist() -> bool:
    """A single process without a process group: DCP then skips its collectives."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every single-process save/load that it assumes one process; we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


def _save_file(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    state: dict[str, Any] = {
        "python": random.getstate(),
        # numpy's state holds an ndarray, which weights_only loading refuses; store it as a tensor.
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's current device
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])

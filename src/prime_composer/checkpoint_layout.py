"""Where checkpoints live, and the one writer every process commits its part of a step through.

    <output_dir>/checkpoints/step_<N>/<part>/         one part per process (trainer, orchestrator, diloco)
    <output_dir>/checkpoints/step_<N>/<part>.STABLE   "this part of step N is written" (+ the parts it expects)
    <output_dir>/checkpoints/step_<N>/STABLE          "step N is complete": every part is there and verifies

Step N means "the state before step N runs": the trainer's model after N optimizer steps and
the orchestrator's data position before it produces batch N. Which parts a run's checkpoints
have is ``config/processes.py``'s registry (``ckpt.parts``, filled in by ``rl``).

A checkpoint is one unit (like a DCP checkpoint or torchtitan's): its parts are written by
different processes at different times, so each writer publishes its part (files, manifest,
rename, part marker) and then tries to *commit* the step: when every expected part has its
marker and its files match its manifest, the step-wide ``STABLE`` is written. Each writer writes
its own marker before it looks at the others', so whichever finishes last commits (both may:
the marker is the same either way). Only committed steps are resumed from, and steps are
pruned as units: the newest ``keep`` committed steps stay, with every step newer than the newest
committed one (still being written); everything older goes, marker first. A write that fails
(a full disk) removes its partial files and leaves every committed step untouched, so the
newest one stays resumable.

Integrity: every part directory holds ``MANIFEST.json`` (size and SHA-256 of each file, written
before the marker; ``prime_composer.integrity``). Committing checks the sizes (the writer of
each part computed its digests from what reached the disk); resuming checks every digest: a run
resumes from the newest committed step whose parts all verify, and a newer one that does not is
skipped, with the reason. No torch import: the orchestrator uses this too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prime_composer.config.errors import ConfigError
from prime_composer.integrity import IntegrityError, read_manifest, verify_manifest, write_manifest
from prime_composer.io import atomic_write_text

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")
_PART_NAME = re.compile(r"[A-Za-z0-9_-]+")
MARKER_SUFFIX = ".STABLE"
STEP_MARKER = "STABLE"
DEFAULT_PARTS: tuple[str, ...] = ("trainer", "orchestrator")
"""The parts of a plain RL run's checkpoints (``config/processes.py`` decides them for a run)."""


class CheckpointWriteError(OSError):
    """A checkpoint part could not be written (its partial files are gone; committed steps are intact)."""


def parse_step_dir(path: Path) -> int | None:
    """N for a ``step_<N>`` directory name (checkpoints, rollouts, broadcasts), else None."""
    match = _STEP_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


def step_dir(root: Path, step: int) -> Path:
    """``<root>/step_<step>``, shared by every part of that step."""
    return Path(root) / f"step_{step}"


def marker_path(root: Path, step: int, part: str) -> Path:
    """The marker of ``part`` at ``step``: ``<root>/step_<N>/<part>.STABLE``."""
    return step_dir(root, step) / f"{part}{MARKER_SUFFIX}"


def step_marker_path(root: Path, step: int) -> Path:
    """The commit marker of ``step``: ``<root>/step_<N>/STABLE`` (every part written and verified)."""
    return step_dir(root, step) / STEP_MARKER


def part_is_written(root: Path, step: int, part: str) -> bool:
    """Whether ``part`` of ``step`` has been published (its marker and directory exist)."""
    return marker_path(root, step, part).is_file() and (step_dir(root, step) / part).is_dir()


def is_committed(root: Path, step: int) -> bool:
    """Whether ``step`` was committed (every part it expected was written and verified)."""
    return step_marker_path(root, step).is_file()


def is_complete(root: Path, step: int, parts: tuple[str, ...] = ("trainer",)) -> bool:
    """Whether ``step`` is committed and holds every one of ``parts``."""
    return is_committed(root, step) and all(part_is_written(root, step, p) for p in parts)


def all_steps(root: Path) -> list[int]:
    """Every ``step_<N>`` directory under ``root``, complete or not, in increasing order."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = [int(m.group(1)) for e in root.iterdir() if (m := _STEP_DIR.match(e.name)) and e.is_dir()]
    return sorted(steps)


def complete_steps(root: Path, parts: tuple[str, ...] = ("trainer",)) -> list[int]:
    """Committed steps that hold all of ``parts``, in increasing order."""
    return [s for s in all_steps(root) if is_complete(root, s, parts)]


def latest_complete_step(root: Path, parts: tuple[str, ...] = ("trainer",)) -> int | None:
    """The newest committed step holding all of ``parts``, or ``None`` when there is none."""
    steps = complete_steps(root, parts)
    return steps[-1] if steps else None


def verify_step(root: Path, step: int, parts: tuple[str, ...]) -> str | None:
    """None when ``step`` is committed and every one of ``parts`` matches its manifest, else why not."""
    if not is_committed(root, step):
        return f"the step was never committed (no {step_marker_path(root, step).name}: a part is missing)"
    for part in parts:
        if not part_is_written(root, step, part):
            return f"the {part} part is missing (no {part}{MARKER_SUFFIX})"
        try:
            verify_manifest(step_dir(root, step) / part)
        except IntegrityError as e:
            return str(e)
    return None


def _sizes_match(directory: Path) -> str | None:
    """None when every file of ``directory``'s manifest exists with its recorded size, else why not."""
    try:
        files = read_manifest(directory)
    except IntegrityError as e:
        return str(e)
    for name, entry in files.items():
        path = directory / name
        if not path.is_file():
            return f"{path}: listed in the manifest but missing"
        if path.stat().st_size != entry["bytes"]:
            return f"{path}: {path.stat().st_size} bytes but {entry['bytes']} were written"
    return None


@dataclass
class ResumePoint:
    """The step a run resumes from, and the newer checkpoints it had to pass over."""

    step: int
    skipped: list[tuple[int, str]] = field(default_factory=list)
    """``(step, reason)`` of every newer complete checkpoint that did not verify."""


def find_resume_point(
    root: Path, requested: int | None, parts: tuple[str, ...] = DEFAULT_PARTS
) -> ResumePoint:
    """The step to resume from: ``requested`` if complete and intact, else the newest step whose
    ``parts`` are complete and verify.

    Raises ConfigError (the run has nothing to resume from, or the named step is damaged) with
    the fix.
    """
    if requested is not None:
        problem = verify_step(root, requested, parts)
        if problem is not None:
            available = complete_steps(root, parts)
            raise ConfigError(
                f"ckpt.resume_step = {requested}: the checkpoint at {step_dir(root, requested)} cannot be used: "
                f"{problem}. Complete steps: {available or 'none'}; resume from another (or drop "
                "ckpt.resume_step to take the newest one that verifies)"
            )
        return ResumePoint(requested)
    skipped: list[tuple[int, str]] = []
    for step in reversed(complete_steps(root, parts)):
        problem = verify_step(root, step, parts)
        if problem is None:
            for bad, reason in skipped:
                logger.warning("not resuming from checkpoint step %d: %s", bad, reason)
            return ResumePoint(step, skipped)
        skipped.append((step, problem))
    detail = "; ".join(f"step {s}: {r}" for s, r in skipped)
    raise ConfigError(
        f"ckpt.resume is set but {root} holds no complete, intact checkpoint of {'+'.join(parts)}"
        + (f" ({detail})" if detail else "")
        + "; run without --resume to start fresh (set ckpt.interval to write checkpoints)"
    )


def resume_step(root: Path, requested: int | None, parts: tuple[str, ...] = DEFAULT_PARTS) -> int:
    """``find_resume_point(...).step``."""
    return find_resume_point(root, requested, parts).step


class StepCheckpoints:
    """Writes, commits and prunes the step checkpoints under ``root``: the one manager every part goes
    through (the trainer's DCP shards, the orchestrator's state, the DiLoCo state via its own
    ``save``, then ``commit``).

    ``parts``: the parts this writer knows every step of the run has (a step commits once the union
    of what its writers expect is written); ``keep``: how many committed steps stay.
    """

    def __init__(self, root: Path, keep: int, parts: tuple[str, ...] = DEFAULT_PARTS) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (how many complete checkpoints to keep), got {keep}")
        for part in parts:
            if not _PART_NAME.fullmatch(part):
                raise ValueError(f"checkpoint part name {part!r} must be letters, digits, '_' or '-'")
        self.root = Path(root)
        self.keep = keep
        self.parts = tuple(parts)

    def tmp_dir(self, step: int, part: str) -> Path:
        """Where ``part`` of ``step`` is written before it is published (``step_<N>/.<part>.tmp``)."""
        return step_dir(self.root, step) / f".{part}.tmp"

    def write_part(self, step: int, part: str, write: Callable[[Path], None], commit: bool = True) -> Path:
        """``write(tmp)`` for one process's whole part, then ``publish`` it; a failure of either is a
        ``CheckpointWriteError`` (partial files removed) naming the newest complete step.
        ``commit=False``: publish only, the writer of the step's other parts commits it (the trainer,
        after the DiLoCo part, with its own ``keep``)."""
        tmp = self.tmp_dir(step, part)
        try:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that crashed
            tmp.mkdir(parents=True)
            write(tmp)
            write_manifest(tmp)
            return self.publish(step, part, commit=commit)
        except OSError as e:
            raise self.failed(step, part, e) from e

    def publish(self, step: int, part: str, commit: bool = True) -> Path:
        """Rename ``part``'s written tmp dir (holding its ``MANIFEST.json``) into place, write its
        marker, then (``commit``) ``commit`` the step if it is now complete. Re-publishing a part
        replaces it (the step is uncommitted first)."""
        final = step_dir(self.root, step) / part
        marker = marker_path(self.root, step, part)
        if final.exists() or marker.exists():
            step_marker_path(self.root, step).unlink(missing_ok=True)  # no longer complete before it changes
            marker.unlink(missing_ok=True)
            shutil.rmtree(final, ignore_errors=True)
        os.replace(self.tmp_dir(step, part), final)
        _fsync_dir(final.parent)
        atomic_write_text(marker, json.dumps({"step": step, "part": part, "parts": list(self.parts)}) + "\n")
        if commit:
            self.commit(step)
        return final

    def failed(self, step: int, part: str, error: BaseException) -> CheckpointWriteError:
        """Remove ``part``'s partial files of ``step``; the error to raise, saying what is intact."""
        shutil.rmtree(self.tmp_dir(step, part), ignore_errors=True)
        intact = [s for s in all_steps(self.root) if is_committed(self.root, s)]
        return CheckpointWriteError(
            f"the {part} checkpoint of step {step} could not be written under {step_dir(self.root, step)} "
            f"({type(error).__name__}: {error}); its partial files were removed; the newest complete "
            f"checkpoint is {f'step {intact[-1]}' if intact else 'none'}. Free space (or lower ckpt.keep) "
            "and resume"
        )

    def expected_parts(self, step: int) -> set[str]:
        """The parts ``step`` must hold: this writer's ``parts`` and those its other writers expect."""
        expected = set(self.parts)
        for marker in step_dir(self.root, step).glob(f"*{MARKER_SUFFIX}"):
            with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
                expected.update(str(p) for p in json.loads(marker.read_text()).get("parts", []))
        return expected

    def commit(self, step: int) -> bool:
        """Write ``step``'s ``STABLE`` if every expected part is written and matches its manifest's
        sizes, then prune; returns whether the step is committed. Idempotent."""
        if is_committed(self.root, step):
            return True
        expected = sorted(self.expected_parts(step))
        for part in expected:
            if not part_is_written(self.root, step, part):
                return False  # another process has not published its part yet: it commits
        for part in expected:
            problem = _sizes_match(step_dir(self.root, step) / part)
            if problem is not None:
                logger.error("checkpoint of step %d not committed: %s", step, problem)
                return False
        atomic_write_text(
            step_marker_path(self.root, step), json.dumps({"step": step, "parts": expected}) + "\n"
        )
        logger.info("checkpoint of step %d complete (%s)", step, "+".join(expected))
        self.prune()
        return True

    def prune(self) -> None:
        """Keep the newest ``keep`` committed steps and every step newer than the newest committed
        one (its parts are still being written); delete the rest, marker first."""
        steps = all_steps(self.root)
        committed = [s for s in steps if is_committed(self.root, s)]
        if not committed:
            return
        kept = set(committed[-self.keep :]) | {s for s in steps if s > committed[-1]}
        for step in steps:
            if step not in kept:
                remove_step(self.root, step)


def remove_step(root: Path, step: int) -> None:
    """Delete every part of ``step``: its commit marker first, so a half-deleted step never looks
    complete."""
    directory = step_dir(root, step)
    step_marker_path(root, step).unlink(missing_ok=True)
    for marker in directory.glob(f"*{MARKER_SUFFIX}"):
        marker.unlink(missing_ok=True)
    shutil.rmtree(directory, ignore_errors=True)


def prune_part(root: Path, part: str, keep: int, keep_also: int | None = None) -> None:
    """Steps are pruned as units now (``StepCheckpoints.prune``); kept for callers that prune after
    writing one part (``part`` and ``keep_also`` no longer change what is kept)."""
    del part, keep_also
    StepCheckpoints(root, keep, parts=()).prune()


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

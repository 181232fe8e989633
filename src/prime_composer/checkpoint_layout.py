"""Where checkpoints live, shared by every process that writes a part of one.

    <output_dir>/checkpoints/step_<N>/<part>/         one part per process (trainer, orchestrator, ...)
    <output_dir>/checkpoints/step_<N>/<part>.STABLE   written last: "this part of step N is complete"

Step N means "the state before step N runs": the trainer's model after N optimizer steps and
the orchestrator's data position before it produces batch N. Which parts a run's checkpoints
have is ``config/processes.py``'s registry (``ckpt.parts``, filled in by ``rl``).

Integrity: every part directory holds ``MANIFEST.json`` (size and SHA-256 of each file, written
before the marker; ``prime_composer.integrity``). A run resumes from the newest step whose parts
are all complete *and* verify; a newer step that does not verify is skipped, with the reason. No
torch import: the orchestrator uses this too.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from prime_composer.config.errors import ConfigError
from prime_composer.integrity import IntegrityError, verify_manifest

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")
MARKER_SUFFIX = ".STABLE"
DEFAULT_PARTS: tuple[str, ...] = ("trainer", "orchestrator")
"""The parts of a plain RL run's checkpoints (``config/processes.py`` decides them for a run)."""


def parse_step_dir(path: Path) -> int | None:
    """N for a ``step_<N>`` directory name (checkpoints, rollouts, broadcasts), else None."""
    match = _STEP_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


def step_dir(root: Path, step: int) -> Path:
    """``<root>/step_<step>``, shared by every part of that step."""
    return Path(root) / f"step_{step}"


def marker_path(root: Path, step: int, part: str) -> Path:
    """The completeness marker of ``part`` at ``step``: ``<root>/step_<N>/<part>.STABLE``."""
    return step_dir(root, step) / f"{part}{MARKER_SUFFIX}"


def is_complete(root: Path, step: int, parts: tuple[str, ...] = ("trainer",)) -> bool:
    """Whether every one of ``parts`` of ``step`` has been completely written."""
    return all(marker_path(root, step, p).is_file() and (step_dir(root, step) / p).is_dir() for p in parts)


def all_steps(root: Path) -> list[int]:
    """Every ``step_<N>`` directory under ``root``, complete or not, in increasing order."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = [int(m.group(1)) for e in root.iterdir() if (m := _STEP_DIR.match(e.name)) and e.is_dir()]
    return sorted(steps)


def complete_steps(root: Path, parts: tuple[str, ...] = ("trainer",)) -> list[int]:
    """Steps whose ``parts`` are all complete, in increasing order."""
    return [s for s in all_steps(root) if is_complete(root, s, parts)]


def latest_complete_step(root: Path, parts: tuple[str, ...] = ("trainer",)) -> int | None:
    """The newest step whose ``parts`` are all complete, or ``None`` when there is none."""
    steps = complete_steps(root, parts)
    return steps[-1] if steps else None


def verify_step(root: Path, step: int, parts: tuple[str, ...]) -> str | None:
    """None when every one of ``parts`` of ``step`` is complete and matches its manifest, else why not."""
    for part in parts:
        if not is_complete(root, step, (part,)):
            return f"the {part} part is incomplete (no {part}{MARKER_SUFFIX})"
        try:
            verify_manifest(step_dir(root, step) / part)
        except IntegrityError as e:
            return str(e)
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


def prune_part(root: Path, part: str, keep: int, keep_also: int | None = None) -> None:
    """Delete ``part`` of every step except the newest ``keep`` complete ones (and ``keep_also``).

    Incomplete leftovers (crashed saves) go too. Other parts are never touched; a step directory is
    removed only once it is empty. The marker goes first, so a half-deleted part is never taken for
    a complete one.
    """
    kept = set(complete_steps(root, (part,))[-keep:])
    if keep_also is not None:
        kept.add(keep_also)
    for step in all_steps(root):
        if step in kept:
            continue
        directory = step_dir(root, step)
        marker_path(root, step, part).unlink(missing_ok=True)
        shutil.rmtree(directory / part, ignore_errors=True)
        shutil.rmtree(directory / f".{part}.tmp", ignore_errors=True)
        with contextlib.suppress(OSError):  # only succeeds when no other part lives there
            directory.rmdir()

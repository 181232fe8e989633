"""Where checkpoints live, shared by every process that writes a part of one.

    <output_dir>/checkpoints/step_<N>/<part>/         one part per process (trainer, orchestrator, ...)
    <output_dir>/checkpoints/step_<N>/<part>.STABLE   written last: "this part of step N is complete"

Step N means "the state before step N runs": the trainer's model after N optimizer steps and
the orchestrator's data position before it produces batch N. A run resumes from the newest step
whose parts are all complete. No torch import: the orchestrator uses this too.
"""

from __future__ import annotations

import re
from pathlib import Path

from prime_composer.config.errors import ConfigError

_STEP_DIR = re.compile(r"^step_(\d+)$")
MARKER_SUFFIX = ".STABLE"
RESUME_PARTS: tuple[str, ...] = ("trainer", "orchestrator")
"""The parts a run needs to resume (both processes restart from the same step)."""


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


def resume_step(root: Path, requested: int | None, parts: tuple[str, ...] = RESUME_PARTS) -> int:
    """The step to resume from: ``requested`` if complete, else the newest complete one.

    Raises ConfigError (a user mistake: the run has nothing to resume from) with the fix.
    """
    if requested is not None:
        if not is_complete(root, requested, parts):
            available = complete_steps(root, parts)
            raise ConfigError(
                f"ckpt.resume_step = {requested}: no complete checkpoint of {'+'.join(parts)} at "
                f"{step_dir(root, requested)}; complete steps: {available or 'none'}"
            )
        return requested
    latest = latest_complete_step(root, parts)
    if latest is None:
        raise ConfigError(
            f"ckpt.resume is set but {root} holds no complete checkpoint of {'+'.join(parts)}; "
            f"run without --resume to start fresh (set ckpt.interval to write checkpoints)"
        )
    return latest

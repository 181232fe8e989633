"""Preparing ``<output_dir>`` before the processes start: fresh start or resume.

A fresh start must not mix with files of an earlier run (a trainer reading a stale
``rollouts/step_0``, a plot mixing two runs), so it clears them, and refuses to delete
checkpoints unless asked (``launch.overwrite``). A resume from step N keeps the checkpoints,
removes what the interrupted run produced for steps >= N (rollouts, newer weights, metric
lines, newer checkpoint steps), so every step is produced and logged exactly once.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from prime_composer.checkpoint_layout import (
    DEFAULT_PARTS,
    ResumePoint,
    all_steps,
    complete_steps,
    find_resume_point,
    parse_step_dir,
    remove_step,
)
from prime_composer.config.errors import ConfigError
from prime_composer.io import atomic_write_text

TRANSIENT = ("rollouts", "broadcasts", "metrics", "logs", "report.png")


def prepare_fresh(output_dir: Path, overwrite: bool, extra: tuple[str, ...] = ()) -> None:
    checkpoints = output_dir / "checkpoints"
    if complete_steps(checkpoints) and not overwrite:
        raise ConfigError(
            f"output_dir = '{output_dir}' holds checkpoints of an earlier run: continue it with --resume, "
            f"or start over with --launch.overwrite (deletes it), or choose another output_dir"
        )
    for name in (*TRANSIENT, "checkpoints", *extra):
        path = output_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def prepare_resume(
    output_dir: Path, requested_step: int | None, parts: tuple[str, ...] = DEFAULT_PARTS
) -> ResumePoint:
    """Trim ``output_dir`` back to the newest complete checkpoint that verifies; returns it (with
    the newer ones it skipped and why)."""
    point = find_resume_point(output_dir / "checkpoints", requested_step, parts)
    step = point.step
    # Newer checkpoint steps are the interrupted run's future: parts the other process never
    # matched (a full disk), or steps that did not verify. The resumed run writes them again.
    for newer in all_steps(output_dir / "checkpoints"):
        if newer > step:
            remove_step(output_dir / "checkpoints", newer)
    for path in _step_dirs(output_dir / "rollouts"):
        if (parse_step_dir(path) or 0) >= step:
            shutil.rmtree(path)
    for path in _step_dirs(output_dir / "broadcasts"):
        if (parse_step_dir(path) or 0) > step:
            shutil.rmtree(path)
    for metrics in (output_dir / "metrics").glob("*.jsonl"):
        trim_metrics(metrics, before_step=step)
    return point


def trim_metrics(path: Path, before_step: int) -> None:
    """Keep the records of steps < ``before_step`` (the resumed run logs the rest again)."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] < before_step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    atomic_write_text(path, "".join(line + "\n" for line in kept))


def _step_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.is_dir() and parse_step_dir(p) is not None]

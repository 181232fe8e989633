"""Config of experiment tracking: the optional ``[wandb]`` section of an ``rl`` config.

With the section, the launcher (not the processes) owns one W&B run per launch: it logs the
resolved configs once and every line the processes append to ``metrics/<process>.jsonl``
(``prime_composer.tracking``). Without it nothing imports ``wandb``. The field names are
PRIME-RL's (``project``, ``entity``, ``name``, ``group``, ``tags``), so its ``[wandb]`` /
``[monitors.wandb]`` tables read as they are; its ``offline = true`` becomes ``mode = "offline"``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from prime_composer.config.base import BaseConfig


class WandbConfig(BaseConfig):
    """One Weights & Biases run per launch, fed from the metrics files (needs the ``wandb`` extra:
    ``uv sync --extra wandb``)."""

    project: str = "prime-composer"
    """W&B project to log to."""

    entity: str | None = None
    """W&B entity (user or team); ``None`` is the logged-in user's default."""

    name: str | None = None
    """Run name; ``None`` uses the name of ``output_dir``."""

    group: str | None = None
    """W&B group (e.g. the data centers of one DiLoCo run)."""

    tags: list[str] = Field(default_factory=list)
    """Tags attached to the run."""

    mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    """``auto``: ``$WANDB_MODE`` when set, else online when an API key is configured and the W&B
    server answers within a few seconds, else offline (the run stays under ``dir``; upload it
    later with ``wandb sync``). ``online`` fails the launch when the server cannot be reached."""

    dir: Path | None = None
    """Where W&B keeps the run's files; ``None`` is ``<output_dir>/wandb``."""

"""Experiment tracking: the launcher's W&B run, fed from the processes' metrics files.

``start_tracker(config)`` returns ``None`` without a ``[wandb]`` section, and only then is
``wandb`` never imported; the processes never import it at all.
"""

from prime_composer.tracking.tail import MetricsTail
from prime_composer.tracking.wandb_run import (
    WandbTracker,
    online_problem,
    redact,
    resolve_mode,
    start_tracker,
)

__all__ = ["MetricsTail", "WandbTracker", "online_problem", "redact", "resolve_mode", "start_tracker"]

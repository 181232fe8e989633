"""One W&B run per launch, owned by the launcher and fed from ``metrics/*.jsonl``.

Why the launcher and not each process: one run holds every process's curves on one page, the
processes stay free of ``wandb`` (and of its network), and the numbers in W&B are exactly the
ones on disk. Each process gets its own step axis: ``<process>/<key>`` is plotted against
``<process>/step``, the ``step`` field of the same JSONL line (W&B's own ``_step`` only counts
calls), so the trainer's step 7 and the orchestrator's step 7 line up even though they are
logged at different times. Every line in the files is logged, so a resumed launch's run shows the
whole curve so far.

The resolved config is logged once as the run's config, with anything that looks like a secret
redacted (configs hold the *names* of environment variables, which are kept).

Offline by default without network (``mode = "auto"``): the run is written under
``<output_dir>/wandb/`` and can be uploaded later with ``wandb sync``.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import netrc
import os
import re
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from prime_composer.config.tracking import WandbConfig
from prime_composer.tracking.tail import MetricsTail

logger = logging.getLogger(__name__)

REDACTED = "<redacted>"
_SECRET_KEY = re.compile(r"(secret|password|passwd|token|api_?key|credential)", re.IGNORECASE)
_NAME_OF_SECRET = re.compile(r"(_env|_var|_variable|_name)$", re.IGNORECASE)
REACH_TIMEOUT_S = 3.0
"""How long ``mode = "auto"`` waits for the W&B server before going offline."""


def redact(values: Any, key: str = "") -> Any:
    """``values`` with every secret-looking entry replaced (``secret_env`` names a variable: kept)."""
    if isinstance(values, dict):
        return {k: redact(v, str(k)) for k, v in values.items()}
    if isinstance(values, list):
        return [redact(v, key) for v in values]
    if values is not None and _SECRET_KEY.search(key) and not _NAME_OF_SECRET.search(key):
        return REDACTED
    return values


def resolve_mode(mode: str) -> tuple[str, str]:
    """``(mode, why)`` for ``WandbConfig.mode``: ``auto`` becomes online or offline."""
    if mode != "auto":
        return mode, "as configured"
    if env := os.environ.get("WANDB_MODE"):
        return env, "WANDB_MODE"
    base_url = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    host = urlparse(base_url).hostname or "api.wandb.ai"
    if not _has_api_key(host):
        return "offline", "no W&B API key (WANDB_API_KEY or `wandb login`)"
    port = urlparse(base_url).port or (443 if base_url.startswith("https") else 80)
    try:
        socket.create_connection((host, port), timeout=REACH_TIMEOUT_S).close()
    except OSError as e:
        return "offline", f"{host} cannot be reached ({e})"
    return "online", f"{host} reachable"


def online_problem(cfg: WandbConfig) -> str | None:
    """Why an online W&B run could not start, in one line (``None`` when it can, or when the run is
    not online): checked before the run directory is touched, instead of wandb failing after it."""
    if cfg.mode == "disabled":
        return None
    if importlib.util.find_spec("wandb") is None:
        return "[wandb] is set but the wandb package is not installed: `uv sync --extra wandb`, or remove [wandb]"
    mode = os.environ.get("WANDB_MODE", "auto") if cfg.mode == "auto" else cfg.mode
    if mode != "online":
        return None  # offline needs no server; auto goes offline by itself when there is none
    base_url = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    host = urlparse(base_url).hostname or "api.wandb.ai"
    if not _has_api_key(host):
        return (
            f'wandb.mode = "online" but there is no W&B API key for {host} (set WANDB_API_KEY or run '
            '`wandb login`), or use mode = "offline"'
        )
    port = urlparse(base_url).port or (443 if base_url.startswith("https") else 80)
    try:
        socket.create_connection((host, port), timeout=REACH_TIMEOUT_S).close()
    except OSError as e:
        return (
            f'wandb.mode = "online" but {host}:{port} cannot be reached ({e.strerror or e}); '
            'use mode = "offline" (upload later with `wandb sync`) or "auto"'
        )
    return None


def _has_api_key(host: str) -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbTracker:
    """A W&B run that logs the new lines of ``<output_dir>/metrics/*.jsonl`` on every ``tick``."""

    def __init__(self, cfg: WandbConfig, output_dir: Path, config: dict[str, Any]) -> None:
        import wandb

        self.mode, why = resolve_mode(cfg.mode)
        self.dir = Path(cfg.dir) if cfg.dir is not None else Path(output_dir) / "wandb"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name or Path(output_dir).resolve().name,
            group=cfg.group,
            tags=cfg.tags or None,
            mode=self.mode,  # type: ignore[arg-type]  # validated by WandbConfig
            dir=str(self.dir),
            config=redact(config),
            settings=wandb.Settings(console="off", silent=True),
        )
        self.tail = MetricsTail(Path(output_dir) / "metrics")
        self._processes: set[str] = set()
        self.num_logged = 0
        where = f" in {self.run.dir}" if self.mode == "offline" else f": {self.run.url}"
        print(f"rl: W&B run {self.mode} ({why}){where}", flush=True)

    def tick(self, *_: Any) -> None:
        """Log what the processes wrote since the last call (the launcher calls it as it polls)."""
        for process, record in self.tail.new_records():
            if process not in self._processes:
                self._processes.add(process)
                self.run.define_metric(f"{process}/step")
                self.run.define_metric(f"{process}/*", step_metric=f"{process}/step")
            values = {f"{process}/{k}": v for k, v in record.items() if k != "time" and _plottable(v)}
            self.run.log(values)
            self.num_logged += 1

    def finish(self, exit_code: int = 0) -> None:
        """Log the last lines and close the run (marked failed when the launch failed)."""
        self.tick()
        self.run.finish(exit_code=exit_code)
        if self.mode == "offline":
            print(f"rl: W&B run saved offline; upload it with: wandb sync {self.run.dir.rsplit('/', 1)[0]}")


def _plottable(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def start_tracker(rl_config: Any) -> WandbTracker | None:
    """The run's tracker, or ``None`` without ``[wandb]`` (then ``wandb`` is not imported)."""
    cfg: WandbConfig | None = rl_config.wandb
    if cfg is None or cfg.mode == "disabled":
        return None
    try:
        import wandb  # noqa: F401
    except ImportError:
        from prime_composer.config.errors import ConfigError

        raise ConfigError(
            "[wandb] is set but the wandb package is not installed: `uv sync --extra wandb`, "
            "or remove [wandb]"
        ) from None
    return WandbTracker(cfg, rl_config.output_dir, rl_config.model_dump(mode="json"))

"""Process logging: one format for every process (the launcher sends each to its log file)."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(process: str, level: str | None = None) -> logging.Logger:
    """Log to stderr as ``HH:MM:SS process LEVEL message``; ``PRIME_COMPOSER_LOG_LEVEL`` overrides."""
    level = level or os.environ.get("PRIME_COMPOSER_LOG_LEVEL", "INFO")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {process} %(levelname)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Libraries that log every request or file at INFO drown the run's own lines (httpx2 and
    # httpcore2: the fork the mcp SDK's HTTP client uses).
    for noisy in ("httpx", "httpcore", "httpx2", "httpcore2", "uvicorn.access", "filelock", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return logging.getLogger(process)

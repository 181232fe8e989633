"""Config of the batch transport between orchestrator and trainer (``[transport]``).

Both processes must agree on it, so it belongs at the top level of the run config.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from prime_composer.config.base import BaseConfig
from prime_composer.netaddr import is_loopback


class TransportConfig(BaseConfig):
    """How packed micro-batches travel from the orchestrator to the trainer ranks."""

    kind: Literal["filesystem", "zmq"] = "filesystem"
    """``filesystem``: one file per step and rank under ``<output_dir>/rollouts`` (easy to inspect
    and resume); ``zmq``: the orchestrator serves batches over TCP (no shared disk needed)."""

    host: str = "127.0.0.1"
    """zmq only: address the orchestrator binds and the trainer ranks connect to. Anything but
    loopback requires ``secret_env``."""

    port: int = Field(default=5557, ge=1, le=65535)
    """zmq only: TCP port of the orchestrator's batch server."""

    secret_env: str | None = None
    """zmq only: name of the environment variable holding a shared secret; when set, every
    request and batch is signed (HMAC-SHA256) and unsigned or badly signed messages are rejected."""

    receive_timeout_s: float = Field(default=1800.0, gt=0)
    """How long a trainer rank waits for a step's batch before failing with an error."""

    poll_interval_s: float = Field(default=0.05, gt=0)
    """How often a waiting receiver (filesystem) or the batch server (zmq) checks for news."""

    keep_last_steps: int = Field(default=4, ge=1)
    """How many of the newest steps the sender keeps (files or in memory); older ones are
    deleted. Must exceed ``max_async_level`` so the trainer never misses a step."""

    @model_validator(mode="after")
    def _remote_needs_secret(self) -> TransportConfig:
        if self.kind == "zmq" and not is_loopback(self.host) and self.secret_env is None:
            raise ValueError(
                f"transport.host = {self.host!r} is reachable from other machines: set "
                "transport.secret_env to the name of an environment variable holding a shared secret"
            )
        return self

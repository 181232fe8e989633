"""Config of the batch transport between orchestrator and trainer (``[transport]``).

Both processes must agree on it, so it belongs at the top level of the run config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from prime_composer.config.base import BaseConfig
from prime_composer.netaddr import is_loopback


class WeightsOriginConfig(BaseConfig):
    """The trainer side's server of published steps for inference workers on other machines
    (``transport/remote.py``, ``launch/remote.py``). With ``enabled = true``, ``rl`` serves
    ``<output_dir>/broadcasts`` on ``host:port`` for the run, writes
    ``configs/inference-worker.json`` (the inference section with ``inference.weights_origin``
    set to this origin's URL and certificate pin) and ``configs/weights-origin.json``, prints the
    command that starts each worker of ``orchestrator.base_url``, and starts the orchestrator
    once every worker answers ``/health``. Use it with ``launch.remote_inference = true``."""

    enabled: bool = False
    """Serve the weights to remote workers (the section's other keys apply only then)."""

    host: str = "127.0.0.1"
    """Address the origin binds. Off loopback it always serves HTTPS (see ``tls_cert``): the
    workers refuse plain HTTP from another machine."""

    port: int = Field(default=0, ge=0, le=65535)
    """TCP port; 0 (the default): a free one, written into the worker config once bound."""

    advertise_host: str | None = None
    """Address the workers reach the origin at (``None``: ``host``; required when ``host`` is a
    wildcard such as ``0.0.0.0``)."""

    secret_env: str = "PRIME_COMPOSER_WEIGHTS_SECRET"
    """Name of the environment variable holding the secret shared with the workers (requests are
    signed with a key derived from it and every step's manifest is tagged with another; the
    secret itself never crosses the wire). It must be set where ``rl`` and the workers run."""

    tls_cert: Path | None = None
    """PEM certificate to serve (``python -m prime_composer.wire.tls --out DIR``), with
    ``tls_key``. ``None`` off loopback: ``rl`` makes one under ``<output_dir>/weights-origin/``
    on its first run and keeps it (the workers pin its fingerprint)."""

    tls_key: Path | None = None
    """PEM private key of ``tls_cert``."""

    relays: list[str] = Field(default_factory=list)
    """Weights relays near the workers (``https://host:port@sha256:<fingerprint>``, each started
    with ``rl relay`` and ``kind = "weights"``, upstream this origin), written into
    the worker config as ``inference.weights_relays``: the workers try them in order, then this
    origin. ``hf`` workers only."""

    @model_validator(mode="after")
    def _check(self) -> WeightsOriginConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("transport.weights_origin.tls_cert and tls_key go together: set both or neither")
        if self.host in ("0.0.0.0", "::", "") and self.advertise_host is None:
            raise ValueError(
                f"transport.weights_origin.host = {self.host!r} binds every address: set "
                "transport.weights_origin.advertise_host to the one the workers reach"
            )
        if not self.secret_env:
            raise ValueError("transport.weights_origin.secret_env: name an environment variable")
        return self

    @property
    def url_host(self) -> str:
        return self.advertise_host or self.host

    @property
    def plain_http(self) -> bool:
        """Whether it serves plain HTTP: no certificate given and bound to loopback."""
        return self.tls_cert is None and is_loopback(self.host)


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

    weights_origin: WeightsOriginConfig = WeightsOriginConfig()
    """Serve the published weights to inference servers on other machines, which share no
    folder with the trainer (``[transport.weights_origin]``, ``enabled = true``; read by ``rl``
    only)."""

    @model_validator(mode="after")
    def _remote_needs_secret(self) -> TransportConfig:
        if self.kind == "zmq" and not is_loopback(self.host) and self.secret_env is None:
            raise ValueError(
                f"transport.host = {self.host!r} is reachable from other machines: set "
                "transport.secret_env to the name of an environment variable holding a shared secret"
            )
        return self

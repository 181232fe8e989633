"""Keeping the inference server on fresh weights, within the asynchrony bound.

The trainer publishes weights after every step as ``<output_dir>/broadcasts/step_<N>/`` (N =
optimizer steps taken; the base model is step 0). Before producing batch ``s`` the orchestrator
needs the server to run weights of step ``>= s - max_async_level``: it waits for the trainer to
publish them, then asks the server to load the newest published version (``/update_weights``).
So with ``max_async_level = 0`` every batch is sampled on-policy, and with ``k`` the
orchestrator samples up to ``k`` steps ahead of the trainer while the trainer trains.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

from prime_composer.client.http import EndpointClient
from prime_composer.config.client import RetryConfig
from prime_composer.transport.weights import latest_stable

logger = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """The weights a step needs never appeared, or the server refused to load them."""


class PolicySync:
    def __init__(
        self,
        broadcast_root: Path,
        server_url: str,
        *,
        secret_env: str | None = None,
        poll_s: float = 0.1,
        timeout_s: float = 3600.0,
        loaded_step: int = 0,
    ) -> None:
        self.broadcast_root = Path(broadcast_root)
        self.server_url = server_url.rstrip("/").removesuffix("/v1")
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self.loaded_step = loaded_step
        """Weights version the server runs (0 = the base model it started with)."""
        secret = os.environ.get(secret_env) if secret_env else None
        if secret_env and not secret:
            raise WeightSyncError(
                f"orchestrator.inference_secret_env = {secret_env!r} but that environment variable is "
                f"empty; export it with the inference server's secret"
            )
        # Loading a large model can take minutes: one attempt may run 10 min; a refused connection
        # (the server restarting) is retried, a refusal (4xx) is final.
        self._lock = asyncio.Lock()
        self._client = EndpointClient(
            self.server_url, retry=RetryConfig(timeout_s=600.0, max_retries=3), api_key=secret
        )

    async def load_newest(self) -> int:
        """Load the newest published weights if they are newer than the server's; returns the step
        the server runs. Safe to call from several tasks: one load at a time."""
        async with self._lock:
            latest = latest_stable(self.broadcast_root)
            if latest is not None and latest[0] > self.loaded_step:
                await self._load(*latest)
        return self.loaded_step

    async def ensure(self, min_step: int) -> int:
        """Return once the server runs weights of step ``>= min_step``; loads newer ones on the way.

        Returns the loaded step (the ``policy_step`` of what is sampled next).
        """
        deadline = time.monotonic() + self.timeout_s
        while True:
            if await self.load_newest() >= min_step:
                return self.loaded_step
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"waited {self.timeout_s:.0f} s for weights of step {min_step} under "
                    f"{self.broadcast_root} (newest: {self.loaded_step}); is the trainer running? "
                    f"(orchestrator.weights_timeout_s)"
                )
            await asyncio.sleep(self.poll_s)

    async def _load(self, step: int, path: Path) -> None:
        result = await self._client.post_json("/update_weights", {"path": str(path.resolve())})
        if not result.ok:
            raise WeightSyncError(
                f"inference server refused weights {path} after {result.attempts} attempt(s): {result.error}"
            )
        logger.info("inference server now runs weights of step %d", step)
        self.loaded_step = step

    async def aclose(self) -> None:
        await self._client.aclose()

"""Keeping the inference server on fresh weights, within the asynchrony bound.

The trainer publishes weights after every step as ``<output_dir>/broadcasts/step_<N>/`` (N =
optimizer steps taken; the base model is step 0). Before producing batch ``s`` the orchestrator
needs the server to run weights of step ``>= s - max_async_level``: it waits for the trainer to
publish them, then asks the server to load the newest published version (``/update_weights``).
So with ``max_async_level = 0`` every batch is sampled on-policy, and with ``k`` the
orchestrator samples up to ``k`` steps ahead of the trainer while the trainer trains.

With several replicas (``replicas.py``) every update goes to all replicas in the pool at once,
and ``loaded_step`` is the newest step one of them serves: calls go only to the replicas on that
step. A replica that cannot load the weights (no answer, a 5xx) is taken out and brought to the
current step when it is back; a refusal (4xx: a path or secret the server rejects) stops the run,
as it would the next replica too. The run stops only when no replica is left.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

from prime_composer.client.http import EndpointClient
from prime_composer.config.client import RetryConfig
from prime_composer.config.orchestrator import WEIGHTS_LOAD_RETRY
from prime_composer.orchestrator.replicas import Replica, ReplicaPool
from prime_composer.transport.weights import latest_stable
from prime_composer.wire.auth import inference_signer

logger = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """The weights a step needs never appeared, or the server refused to load them."""


class PolicySync:
    def __init__(
        self,
        broadcast_root: Path,
        servers: str | Sequence[str] | ReplicaPool,
        *,
        secret_env: str | None = None,
        poll_s: float = 0.1,
        timeout_s: float = 3600.0,
        loaded_step: int = 0,
        retry: RetryConfig = WEIGHTS_LOAD_RETRY,
    ) -> None:
        """``servers``: one server URL, several, or the pool the rollouts are routed through."""
        self.broadcast_root = Path(broadcast_root)
        if isinstance(servers, ReplicaPool):
            self.pool = servers
        else:
            urls = [servers] if isinstance(servers, str) else list(servers)
            self.pool = ReplicaPool(urls, loaded_step=loaded_step)
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        secret = os.environ.get(secret_env) if secret_env else None
        if secret_env and not secret:
            raise WeightSyncError(
                f"orchestrator.inference_secret_env = {secret_env!r} but that environment variable is "
                f"empty; export it with the inference server's secret"
            )
        # ``orchestrator.weights_load_retry``: one attempt may take minutes (a large model).
        self._lock = asyncio.Lock()
        # Signed calls (``wire.auth``): the secret itself never crosses the wire.
        signer = inference_signer(secret)
        self._clients = [
            EndpointClient(r.url, retry=retry, signer=signer, tls=self.pool.tls) for r in self.pool.replicas
        ]

    @property
    def loaded_step(self) -> int:
        """Weights version the serving replicas run (0 = the base model they started with)."""
        return self.pool.step

    async def load_newest(self) -> int:
        """Load the newest published weights into every replica in the pool that runs older ones;
        returns the step the serving replicas run. Safe to call from several tasks: one load at a
        time."""
        async with self._lock:
            latest = latest_stable(self.broadcast_root)
            if latest is not None:
                behind = [r for r in self.pool.alive if r.loaded_step is None or r.loaded_step < latest[0]]
                if behind:
                    await asyncio.gather(*(self._load(r, *latest) for r in behind))
                    if not self.pool.alive:
                        errors = "; ".join(f"{r.url}: {r.last_error}" for r in self.pool.replicas)
                        raise WeightSyncError(
                            f"no inference server could load the weights of step {latest[0]} ({errors})"
                        )
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

    async def _load(self, replica: Replica, step: int, path: Path) -> None:
        result = await self._clients[replica.index].post_json(
            "/update_weights", {"path": str(path.resolve())}
        )
        if not result.ok:
            refused = result.status is not None and 400 <= result.status < 500
            if refused or len(self.pool.replicas) == 1:
                raise WeightSyncError(
                    f"inference server {replica.url} refused weights {path} after {result.attempts} "
                    f"attempt(s): {result.error}"
                )
            self.pool.record_failure(replica, f"loading step {step}: {result.error}", fatal=True)
            return
        if len(self.pool.replicas) == 1:
            logger.info("inference server now runs weights of step %d", step)
        else:
            logger.info(
                "inference replica %d (%s) now runs weights of step %d", replica.index, replica.url, step
            )
        self.pool.mark_loaded(replica, step)

    async def aclose(self) -> None:
        for client in self._clients:
            await client.aclose()

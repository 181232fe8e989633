"""``POST /update_weights`` and ``POST /reload_weights``, one handler for every backend.

``WeightUpdates`` checks the request (``weight_paths``: 400/403/404/409 before any file is
read), tells a published LoRA step (``transport/adapter.py``) from whole weights, runs one update
at a time, and keeps what is served for ``/health`` (``current``: path and step). How weights
are actually loaded is the backend's ``WeightTarget``:

- ``hf`` (``hf/server.py``): read and verify the files, merge an adapter onto the base weights,
  swap them into the engine between decode iterations;
- ``vllm`` (``vllm/admin.py``): verify the files, then pause vLLM, load through the workers'
  ``collective_rpc`` (whole weights) or vLLM's own LoRA loading (an adapter), resume.

A server on another machine than the trainer (no shared folder) is given a ``remote``
(``transport.remote.RemoteWeights``): the orchestrator sends the same request, naming the
trainer's ``.../broadcasts/step_N``; the server takes only its step number, fetches that step from
the trainer side's ``WeightsOrigin`` into its own ``weights_root`` (signed requests, pinned TLS,
the manifest's tag and every digest checked; off the event loop), and then loads it from there as
any local step. A step that cannot be fetched or does not verify is an ``APIError(502)``, and the
server keeps what it served.

A content problem (a digest mismatch, non-finite values, a shape the model does not have) is an
``APIError(409)`` naming the file, a step pruned meanwhile a 404, and the server keeps what it
served. Imports only what vLLM's own environment has (the vLLM middleware imports this there);
``transport`` is imported when a route runs.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Protocol

from prime_composer.inference.guard import APIError

logger = logging.getLogger(__name__)


class WeightTarget(Protocol):
    """What a backend loads a checked step directory into."""

    async def load_weights(self, path: Path) -> None:
        """Serve the whole weights published in ``path`` (in place of any adapter)."""
        ...

    async def load_adapter(self, path: Path) -> None:
        """Serve the base weights with the LoRA adapter published in ``path`` (in place of the
        previous adapter, never on top of it)."""
        ...

    async def reload_base(self) -> None:
        """Serve the weights the server started with again (no adapter)."""
        ...


class WeightUpdates:
    """The two routes' logic over a ``WeightTarget`` (see the module docstring)."""

    def __init__(self, weights_root: Path, remote: Any = None) -> None:
        self.weights_root = Path(weights_root)
        self.remote = remote
        """A ``transport.remote.RemoteWeights`` to fetch each step from, or None (a shared folder)."""
        self.current: dict[str, Any] = {"path": None, "step": None}
        """What is served: the step directory and its step, or ``None`` for the base weights."""
        self._lock: asyncio.Lock | None = None  # made lazily, inside the server's event loop

    def _serialized(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def update(self, body: bytes, target: WeightTarget) -> dict[str, Any]:
        """Handle ``POST /update_weights`` with request ``body``; the response body."""
        from prime_composer.inference.weight_paths import (
            WeightPathError,
            checked_step_dir,
            update_path_from_body,
        )
        from prime_composer.transport.adapter import is_adapter
        from prime_composer.transport.weights import parse_step

        try:
            raw = update_path_from_body(body)
            if self.remote is not None:
                raw = await self._fetch(raw)
            path = checked_step_dir(raw, self.weights_root)
        except WeightPathError as e:
            raise APIError(e.status, e.message) from None
        async with self._serialized():
            if is_adapter(path):
                await target.load_adapter(path)
            else:
                await target.load_weights(path)
            self.current.update(path=str(path), step=parse_step(path))
        logger.info("serving weights from %s", path)
        return {"status": "ok", **self.current}

    async def _fetch(self, raw: str) -> str:
        """Fetch the step ``raw`` names from ``remote`` into ``weights_root``; its local path."""
        from prime_composer.inference.weight_paths import WeightPathError
        from prime_composer.transport.remote import RemoteWeightsError
        from prime_composer.transport.weights import parse_step

        step = parse_step(Path(raw))
        if step is None:
            raise WeightPathError(400, f"path {raw[:200]!r} does not name a step_<N> directory")
        try:
            fetched = await asyncio.to_thread(self.remote.fetch, step, self.weights_root)
        except RemoteWeightsError as e:
            raise APIError(502, f"step {step} could not be fetched from the trainer: {e}") from None
        return str(fetched)

    async def reload(self, target: WeightTarget) -> dict[str, Any]:
        """Handle ``POST /reload_weights``; the response body."""
        async with self._serialized():
            await target.reload_base()
            self.current.update(path=None, step=None)
        logger.info("serving the base weights again")
        return {"status": "ok", **self.current}

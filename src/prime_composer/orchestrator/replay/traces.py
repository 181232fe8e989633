"""The run's own rollouts as traces for the teacher service to replay (``POST /v1/traces``).

``orchestrator/trace_export.py`` turns the Samples into traces of ``teacher/traces.py``'s schema
(one per episode; the one converter from Samples to the teacher). Sending runs in the background through ``EndpointClient``; a failed or refused
batch is counted (``replay/traces_failed``), never a crash.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from prime_composer.client.http import EndpointClient
from prime_composer.config.client import RetryConfig
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.trace_export import samples_to_traces

logger = logging.getLogger(__name__)


class TraceSender:
    """Posts traces to the teacher service in the background."""

    def __init__(self, base_url: str, api_key: str | None) -> None:
        self.client = EndpointClient(
            base_url, retry=RetryConfig(timeout_s=30.0, max_retries=2), api_key=api_key
        )
        self.num_sent = 0
        self.num_failed = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def send(self, samples: list[Sample]) -> None:
        traces = samples_to_traces(samples)
        if traces:
            task = asyncio.create_task(self._post(traces))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _post(self, traces: list[dict[str, Any]]) -> None:
        result = await self.client.post_json("/v1/traces", {"traces": traces})
        if result.ok:
            self.num_sent += len(result.data.get("accepted", []))
            self.num_failed += len(result.data.get("rejected", []))
        else:
            self.num_failed += len(traces)
            logger.warning("teacher service refused %d traces: %s", len(traces), result.error)

    def metrics(self) -> dict[str, float]:
        return {"replay/traces_sent": self.num_sent, "replay/traces_failed": self.num_failed}

    async def aclose(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.aclose()

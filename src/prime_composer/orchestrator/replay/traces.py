"""The run's own rollouts as traces for the teacher service to replay (``POST /v1/traces``).

A sample becomes one trace in ``teacher/traces.py``'s schema: its messages, the reward, and on the
last assistant turn the exact tokens the policy saw and sampled (``prompt_token_ids``,
``token_ids``) with their logprobs (the student's uncertainty, which the service's gate reads).
Agent episodes (samples with per-turn records, ``Sample.info["turns"]``) go through
``trace_export.episode_trace`` instead, one trace per episode (the samples of a split episode share
its ``trace_id``), every assistant turn with its own tokens and tool calls. Sending runs in the background through ``EndpointClient``; a failed or refused
batch is counted (``replay/traces_failed``), never a crash.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from prime_composer.client.http import EndpointClient
from prime_composer.config.client import RetryConfig
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.trace_export import episode_trace

logger = logging.getLogger(__name__)


def sample_to_trace(sample: Sample) -> dict[str, Any] | None:
    """The trace record of a finished sample, or None when it has no messages to replay."""
    messages = sample.info.get("messages") or []
    turns = [
        {"role": m["role"], "content": m.get("content") if isinstance(m.get("content"), str) else ""}
        for m in messages
        if isinstance(m, dict) and m.get("role") in ("system", "user", "assistant", "tool")
    ]
    assistant = [i for i, t in enumerate(turns) if t["role"] == "assistant"]
    if not assistant or sample.error is not None:
        return None
    last = turns[assistant[-1]]
    policy = [i for i, m in enumerate(sample.completion_mask) if m]
    if len(assistant) == 1 and policy:
        last["prompt_token_ids"] = list(sample.prompt_ids)
        last["token_ids"] = [sample.completion_ids[i] for i in policy]
        last["logprobs"] = [sample.completion_logprobs[i] for i in policy]
    trace: dict[str, Any] = {"turns": turns, "reward": sample.reward}
    if sample.info.get("trace_id"):
        trace["id"] = str(sample.info["trace_id"])
    if sample.info.get("task") is not None:
        trace["task"] = sample.info["task"]
    return trace


def samples_to_traces(samples: list[Sample]) -> list[dict[str, Any]]:
    """The trace records of finished samples: one per agent episode, one per plain sample."""
    traces: list[dict[str, Any]] = []
    episodes: dict[str, list[Sample]] = {}
    for sample in samples:
        if "turns" in sample.info and sample.info.get("trace_id") is not None:
            if sample.error is None:
                episodes.setdefault(str(sample.info["trace_id"]), []).append(sample)
        elif (trace := sample_to_trace(sample)) is not None:
            traces.append(trace)
    traces.extend(episode_trace(episode) for episode in episodes.values())
    return traces


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

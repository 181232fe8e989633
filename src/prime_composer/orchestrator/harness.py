"""An in-process verifiers v1 harness: one chat-completions call per segment, token ids recorded.

Why not a built-in harness: verifiers' harnesses launch a program (a ``uv`` script) inside a
runtime, which resolves its dependencies at run time (network), and verifiers' eval client keeps
no token ids on the trace. The ``Harness`` contract allows a loop that runs in-process as long as
every model call goes through the rollout's interception ``endpoint`` (which records the turn
on the trace and relays the provider's JSON back unchanged). So this harness

- sends one non-streaming ``/chat/completions`` request per segment to that endpoint, with
  ``logprobs: true`` and ``return_token_ids: true`` (vLLM >= 0.10.2: top-level
  ``prompt_token_ids``, ``choices[0].token_ids``, ``choices[0].logprobs.content[j].logprob``);
  the model name and sampling knobs are imposed by the interception from the rollout's
  ``ModelContext``;
- appends what the server returned for the call to ``trace.info[TURNS_KEY]`` (a list of
  ``TurnRecord`` dicts), where ``prime_composer.orchestrator.rollout`` assembles a ``Sample``.

A multi-turn environment resumes the harness with the whole conversation; each call appends
one record. Tools (MCP) are not supported: verifiers refuses the pairing before the rollout.
Environments whose tasks use tools (``AgentTaskData``) run with the token-in agent harness
instead (``agent_harness.py``).

verifiers imports harnesses by a plain module name, so ``prime_composer.orchestrator.envs``
registers this module as ``HARNESS_MODULE`` before any environment loads.
"""

from __future__ import annotations

import asyncio
import math
import weakref
from typing import Any, TypedDict

import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

HARNESS_ID = "prime-composer-chat"
"""The id environments pin their agents' harness to (``agent.harness.id``)."""

HARNESS_MODULE = HARNESS_ID.replace("-", "_")
"""The module name verifiers imports for ``HARNESS_ID``."""

TURNS_KEY = "prime_composer_turns"
"""Key of the per-call token records on ``trace.info``."""


class TurnRecord(TypedDict):
    """What one model call returned, as the rollout stage reads it."""

    prompt_token_ids: list[int] | None
    completion_token_ids: list[int] | None
    completion_logprobs: list[float] | None
    """Sampled-token logprobs; ``None`` when the server sent none."""
    finish_reason: str | None
    content: str


class ChatHarnessConfig(vf.HarnessConfig):
    """Config of the in-process chat harness."""

    id: str = HARNESS_ID
    request_timeout_s: float | None = None
    """Read timeout of one model call; ``None`` leaves the bound to the rollout timeout."""


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    """Single chat-completions call per segment, run in the orchestrator's event loop."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
        tool_interception_url: str | None = None,
    ) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages.extend(message_to_wire(m) for m in prompt or [])
        body = {
            "model": ctx.model,
            "messages": messages,
            "stream": False,
            "logprobs": True,
            "return_token_ids": True,
        }
        client = _client_for_loop()
        try:
            response = await client.post(
                f"{endpoint.rstrip('/')}/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {secret}"},
                timeout=httpx.Timeout(30.0, read=self.config.request_timeout_s),
            )
        except httpx.HTTPError as e:
            raise vf.HarnessError(f"model call failed: {type(e).__name__}: {e}") from e
        if response.status_code != 200:
            # The interception already stashed the provider's error as the rollout's real
            # cause; this one only ends the segment.
            raise vf.HarnessError(f"model call returned HTTP {response.status_code}: {response.text[:500]}")
        trace.info.setdefault(TURNS_KEY, []).append(turn_record(response.json()))
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


def turn_record(completion: dict[str, Any]) -> TurnRecord:
    """Pick the token evidence out of a chat.completion JSON (vLLM ``return_token_ids`` form)."""
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    return TurnRecord(
        prompt_token_ids=completion.get("prompt_token_ids"),
        completion_token_ids=choice.get("token_ids"),
        completion_logprobs=_sampled_logprobs(choice.get("logprobs")),
        finish_reason=choice.get("finish_reason"),
        content=message.get("content") or "",
    )


VLLM_LOGPROB_SENTINEL = -9999.0
"""What vLLM reports when it has no logprob for a sampled token (also its lower clamp)."""


def _sampled_logprobs(logprobs: Any) -> list[float] | None:
    """``logprobs.content[j].logprob`` as floats, or ``None`` unless every entry is real evidence."""
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list):
        return None
    floats: list[float] = []
    for entry in content:
        value = entry.get("logprob") if isinstance(entry, dict) else None
        if not isinstance(value, int | float) or isinstance(value, bool):
            return None
        floats.append(float(value))
    if not all(math.isfinite(v) and v != VLLM_LOGPROB_SENTINEL for v in floats):
        return None
    return floats


_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
    weakref.WeakKeyDictionary()
)


def _client_for_loop() -> httpx.AsyncClient:
    """One client per event loop (an httpx client must not cross loops); building one per call
    would cost a TLS context each time.

    No keep-alive: the interception servers come and go with the load (verifiers' elastic pool), and
    a pooled connection to one that closed fails the next call with a ``ReadError``: a lost rollout,
    at random. A call here must not be retried either (the interception records every call as a
    turn), so each call opens its own loopback connection (tens of microseconds)."""
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None:
        client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))
        _clients[loop] = client
    return client


__all__ = ["ChatHarness", "ChatHarnessConfig"]

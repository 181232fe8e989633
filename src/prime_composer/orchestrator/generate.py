"""Token-in, token-out sampling from the inference server: ``POST /inference/v1/generate``.

The contract (vLLM's, which the embedded server implements too): the request carries the prompt
as ``token_ids`` and vLLM ``SamplingParams`` (``logprobs: 0`` asks for the sampled token's
logprob); the answer's ``choices[0]`` has ``token_ids``, ``logprobs.content[j].logprob``
(post-temperature) and ``finish_reason``. ``GET /v1/models`` gives ``max_model_len``.

Unlike chat calls through verifiers' interception (which records every call as a turn, so they
must not be retried), these calls go straight to the server and record nothing: they are retried
by ``EndpointClient`` on 5xx, timeouts and connection errors. A call that still fails, or an
answer without evidence (token ids, finite logprobs of the same length), raises
``ModelCallError``: the episode becomes an error sample.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import weakref
from typing import Any

from prime_composer.client.http import EndpointClient
from prime_composer.config.client import RetryConfig
from prime_composer.netaddr import server_root
from prime_composer.orchestrator.episode import Generation, ModelCallError

GENERATE_PATH = "/inference/v1/generate"

LOGPROB_SENTINEL = -9999.0
"""What vLLM reports when it has no logprob for a token (also its lower clamp)."""

RENDER_ONLY_FIELDS = frozenset({"chat_template_kwargs"})
"""Sampling fields that shape the rendering (the harness renders) rather than the sampling."""


class TokenPolicy:
    """One episode's sampler: the model name, the sampling fields, and a shared client."""

    def __init__(self, client: TokenClient, model: str, sampling: dict[str, Any]) -> None:
        self.client = client
        self.model = model
        self.sampling = {k: v for k, v in sampling.items() if k not in RENDER_ONLY_FIELDS and v is not None}
        self.sampling.pop("max_tokens", None)

    async def generate(self, prompt_ids: list[int], max_tokens: int, turn: int) -> Generation:
        params = {**self.sampling, "max_tokens": max_tokens, "logprobs": 0, "n": 1}
        if "seed" in params:  # one seed per episode would repeat the same draws every turn
            params["seed"] = turn_seed(int(params["seed"]), turn)
        return await self.client.generate(self.model, prompt_ids, params)


def turn_seed(seed: int, turn: int) -> int:
    """A 31-bit seed for turn ``turn`` of the episode whose seed is ``seed``."""
    digest = hashlib.blake2b(f"{seed}:turn:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


class TokenClient:
    """Calls ``/inference/v1/generate`` on one server (see the module docstring)."""

    def __init__(self, base_url: str, *, api_key: str | None, retry: RetryConfig) -> None:
        self.http = EndpointClient(server_root(base_url), retry=retry, api_key=api_key)
        self._max_model_len: int | None = None
        self._asked_limit = False

    async def generate(self, model: str, prompt_ids: list[int], params: dict[str, Any]) -> Generation:
        result = await self.http.post_json(
            GENERATE_PATH, {"model": model, "token_ids": prompt_ids, "sampling_params": params}
        )
        if not result.ok:
            raise ModelCallError(f"{GENERATE_PATH} failed after {result.attempts} attempt(s): {result.error}")
        return parse_generation(result.data)

    async def max_model_len(self) -> int | None:
        """The served model's context limit from ``/v1/models`` (asked once), if it reports one."""
        if not self._asked_limit:
            self._asked_limit = True
            result = await self.http.get_json("/v1/models")
            try:
                value = result.data["data"][0]["max_model_len"] if result.ok else None
            except (KeyError, IndexError, TypeError):
                value = None
            self._max_model_len = value if isinstance(value, int) and value > 0 else None
        return self._max_model_len

    async def aclose(self) -> None:
        await self.http.aclose()


def parse_generation(data: Any) -> Generation:
    """The sampled tokens of a generate answer; ``ModelCallError`` when the evidence is missing."""
    try:
        choice = data["choices"][0]
        token_ids = choice["token_ids"]
    except (KeyError, IndexError, TypeError):
        raise ModelCallError("the generate answer has no choices[0].token_ids") from None
    if not isinstance(token_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in token_ids
    ):
        raise ModelCallError("choices[0].token_ids is not a list of token ids")
    content = (
        (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
    )
    if not isinstance(content, list):
        raise ModelCallError("the generate answer has no logprobs (the request asks for logprobs: 0)")
    logprobs = []
    for entry in content:
        value = entry.get("logprob") if isinstance(entry, dict) else None
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ModelCallError("a logprob in the generate answer is not a number")
        if not math.isfinite(value) or value == LOGPROB_SENTINEL:
            raise ModelCallError(
                f"the generate answer holds a logprob of {value}: no evidence for that token"
            )
        logprobs.append(float(value))
    if len(logprobs) != len(token_ids):
        raise ModelCallError(
            f"{len(token_ids)} token ids but {len(logprobs)} logprobs in the generate answer"
        )
    finish = choice.get("finish_reason")
    return Generation(
        token_ids=list(token_ids),
        logprobs=logprobs,
        finish_reason=finish if isinstance(finish, str) else None,
    )


_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str, str], TokenClient]] = (
    weakref.WeakKeyDictionary()
)


def client_for(base_url: str, api_key_var: str, retry: RetryConfig) -> TokenClient:
    """The running loop's client for this server and key (a connection pool is bound to a loop)."""
    per_loop = _clients.setdefault(asyncio.get_running_loop(), {})
    key = (base_url, api_key_var, retry.model_dump_json())
    client = per_loop.get(key)
    if client is None:
        api_key = os.environ.get(api_key_var) or None
        client = per_loop[key] = TokenClient(base_url, api_key=api_key, retry=retry)
    return client


async def close_clients() -> None:
    """Close the running loop's clients (their connection pools)."""
    for client in _clients.pop(asyncio.get_running_loop(), {}).values():
        await client.aclose()

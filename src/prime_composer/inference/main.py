"""``inference``: the OpenAI-compatible server, alone from its config.

    uv run inference @ outputs/run/configs/inference.json
    uv run inference --model.name builtin:tiny-qwen3 --port 8000

``inference.backend`` picks the server from the registry (``backend.py``): ``hf`` serves with
the embedded transformers engine (``hf/``), ``vllm`` launches vLLM with our weight-update
extension (``vllm/``).
"""

from __future__ import annotations

from prime_composer.config.cli import exit_process, run_entry_point
from prime_composer.config.errors import ConfigError
from prime_composer.config.inference import InferenceConfig
from prime_composer.inference.auth import resolve_admin_secret
from prime_composer.inference.backend import get_backend
from prime_composer.logs import setup_logging


def check_bind(config: InferenceConfig) -> None:
    """A bind the server would refuse (no secret off loopback, an unset secret variable), said at
    once: before torch or vLLM is imported, and by ``--dry-run``."""
    try:
        resolve_admin_secret(config.host, config.secret_env)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def run(config: InferenceConfig) -> int:
    check_bind(config)
    setup_logging("inference")
    get_backend(config.backend).serve(config)
    return 0


def main() -> None:
    exit_process(
        run_entry_point(
            InferenceConfig,
            run,
            prog="inference",
            env_prefix="PRIME_COMPOSER_INFERENCE__",
            describe="Serve the policy over an OpenAI-compatible API with live weight updates.",
            check=check_bind,
        )
    )


if __name__ == "__main__":
    main()

"""``inference``: the OpenAI-compatible server, alone from its config.

    uv run inference @ outputs/run/configs/inference.json
    uv run inference --model.name builtin:tiny-qwen3 --port 8000

``inference.backend`` picks the server from the registry (``backend.py``): ``hf`` serves with
the embedded transformers engine (``hf/``), ``vllm`` launches vLLM with our weight-update
extension (``vllm/``).
"""

from __future__ import annotations

import sys

from prime_composer.config.cli import run_entry_point
from prime_composer.config.inference import InferenceConfig
from prime_composer.logs import setup_logging


def run(config: InferenceConfig) -> int:
    setup_logging("inference")
    if config.backend == "vllm":
        from prime_composer.inference.vllm import serve_vllm

        serve_vllm(config)
    else:
        from prime_composer.inference.hf.server import serve

        serve(config)
    return 0


def main() -> None:
    sys.exit(
        run_entry_point(
            InferenceConfig,
            run,
            prog="inference",
            env_prefix="PRIME_COMPOSER_INFERENCE__",
            describe="Serve the policy over an OpenAI-compatible API with live weight updates.",
        )
    )


if __name__ == "__main__":
    main()

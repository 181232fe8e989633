"""``orchestrator``: run the orchestrator alone from its config.

    uv run orchestrator @ outputs/run/configs/orchestrator.json

(``rl`` starts it with the config it resolved; see ``loop.py`` for what it does.)
"""

from __future__ import annotations

import asyncio
import logging

from prime_composer.config.cli import exit_process, run_entry_point
from prime_composer.config.errors import ConfigError
from prime_composer.config.orchestrator import OrchestratorConfig
from prime_composer.logs import setup_logging
from prime_composer.start_gate import wait_start_gate

logger = logging.getLogger(__name__)


def run(config: OrchestratorConfig) -> int:
    setup_logging("orchestrator")
    from prime_composer.model.resolve import load_tokenizer
    from prime_composer.orchestrator.channel import ChannelContext, build_channels
    from prime_composer.orchestrator.envs import load_envs
    from prime_composer.orchestrator.loop import Orchestrator

    tokenizer = load_tokenizer(
        config.model.name, revision=config.model.revision, gguf_file=config.model.gguf_file
    )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    try:
        envs = load_envs(config.env, config.rollout)
    except ValueError as e:  # names the offending orchestrator.env entry
        raise ConfigError(str(e)) from None
    # Started by ``rl`` with the inference server: everything above loaded while it started; the
    # first request waits for the launcher to find the services healthy (``start_gate.py``).
    waited = wait_start_gate()
    if waited >= 0.05:
        logger.info("waited %.1f s for the services to be healthy (setup done before them)", waited)
    try:
        parts = build_channels(config, ChannelContext(tokenizer=tokenizer))
    except ValueError as e:  # names the orchestrator.<channel> key to fix
        raise ConfigError(str(e)) from None
    orchestrator = Orchestrator(config, envs, pad_token_id=pad_id, channels=parts)
    asyncio.run(orchestrator.run())
    return 0


def main() -> None:
    exit_process(
        run_entry_point(
            OrchestratorConfig,
            run,
            prog="orchestrator",
            env_prefix="PRIME_COMPOSER_ORCHESTRATOR__",
            describe="Sample rollouts, score them, and send packed batches to the trainer.",
        )
    )


if __name__ == "__main__":
    main()

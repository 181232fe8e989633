"""``teacher``: run the trace-replay service alone from its config.

    uv run teacher @ teacher.toml                       # serve until stopped
    uv run teacher @ teacher.toml --no-serve            # replay what is pending, then exit
    uv run teacher @ outputs/run/configs/teacher.json   # as ``rl`` will start it

Only the config is imported before the command line is parsed, so ``--help`` is fast; torch is
imported when the first pair needs reference logprobs.
"""

from __future__ import annotations

import os

from prime_composer.config.cli import exit_process, run_entry_point
from prime_composer.config.teacher import TeacherServiceConfig
from prime_composer.logs import setup_logging


def run(config: TeacherServiceConfig) -> int:
    setup_logging("teacher")
    if config.nice:  # below the RL step's processes on shared cores (``teacher.nice``)
        os.nice(config.nice)
    from prime_composer.teacher.service import run_service

    return run_service(config)


def main() -> None:
    exit_process(
        run_entry_point(
            TeacherServiceConfig,
            run,
            prog="teacher",
            env_prefix="PRIME_COMPOSER_TEACHER__",
            describe="Replay frozen traces, ask teacher LLMs at the steps worth it, write DPO pairs.",
        )
    )


if __name__ == "__main__":
    main()

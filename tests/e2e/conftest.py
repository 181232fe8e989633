"""Helpers for running the real ``rl`` launcher in tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from prime_composer.config import ports

REPO = Path(__file__).resolve().parents[2]


_TAKEN: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on, never the same one twice in this test process (the
    library's picker, ``prime_composer.config.ports.free_port``)."""
    return ports.free_port("127.0.0.1", _TAKEN)


def rl_command(output_dir: Path, *overrides: str, config: str = "quickstart.toml") -> list[str]:
    """``rl @ configs/<config>`` (the quickstart by default) shrunk to a few cheap steps, in
    ``output_dir``."""
    return [
        sys.executable,
        "-m",
        "prime_composer.launch.rl",
        "@",
        str(REPO / "configs" / config),
        "--output-dir",
        str(output_dir),
        "--inference.port",
        str(free_port()),
        "--no-launch.progress",
        "--launch.health-timeout-s",
        "600",
        "--orchestrator.batch-size",
        "16",
        "--orchestrator.group-size",
        "4",
        "--orchestrator.max-refill-rounds",
        "1",
        "--orchestrator.eval.interval",
        "2",
        # The warm-up is proven by running, not by its quality: 20 steps (the quickstart's 240
        # take minutes here); a test that needs a better-trained model sets more after these.
        "--warmup.max-steps",
        "20",
        "--warmup.num-examples",
        "320",
        # That weak a warm-up earns reward 0 in most groups (0, 0, 0.06 over the first 3 steps
        # with seed 0; 0, 0, 0 on another CPU), and 3 steps in a row with nothing to train on
        # would stop the run: a test of the stop itself sets the limit back after these.
        "--orchestrator.failure.max-empty-steps",
        "1000",
        *overrides,
    ]


def run_rl(
    output_dir: Path, *overrides: str, timeout: float = 900, config: str = "quickstart.toml"
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        rl_command(output_dir, *overrides, config=config),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def metric_steps(output_dir: Path, process: str) -> list[int]:
    path = output_dir / "metrics" / f"{process}.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]

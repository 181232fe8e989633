"""Runs that used to finish with exit 0 and "done" having learned nothing now stop with an error
that says which and why, and the launcher does not suggest a resume that would fail the same way.
(``group_size 1`` is refused by the config: ``tests/unit/test_config_cli.py``.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "e2e_launch_helpers", Path(__file__).resolve().parents[1] / "e2e" / "conftest.py"
)
assert _spec is not None and _spec.loader is not None
_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_helpers)

QUICK = (
    "--max-steps",
    "4",
    "--no-warmup.enabled",
    "--orchestrator.eval.interval",
    "0",
    "--ckpt.interval",
    "0",
)


@pytest.mark.slow
def test_a_context_too_short_for_any_rollout_is_refused_before_the_run(tmp_path: Path) -> None:
    # A context of 8 tokens: every prompt is longer, every rollout would be an error sample. The
    # preflight refuses it before any process starts (the stop after failed rollouts at run time
    # is tests/unit/test_run_failures.py's).
    proc = _helpers.run_rl(tmp_path, *QUICK, "--inference.max-model-len", "8", timeout=600)
    assert proc.returncode != 0 and "rl: done" not in proc.stdout
    assert "max_model_len" in proc.stdout + proc.stderr
    assert not (tmp_path / "logs").exists()


@pytest.mark.slow
def test_a_destroyed_policy_stops_the_run(tmp_path: Path, quickstart_warmup: Path) -> None:
    # From the quickstart's short warm-up (trained once per test run, tests/conftest.py), so that
    # rewards differ within groups and the first step really trains (from the random model every
    # group is all zeros and nothing would be trained on at all). Steps to spare: a step whose
    # groups all tie trains nothing, and each stop needs a few bad steps in a row (synchronous,
    # so that the first bad weights reach the very next rollouts).
    warm = (
        "--max-steps",
        "12",
        "--max-async-level",
        "0",
        "--no-warmup.enabled",
        "--model.name",
        str(quickstart_warmup),
    )
    quiet = ("--orchestrator.eval.interval", "0", "--ckpt.interval", "0")
    stops = ("--orchestrator.failure.max-empty-steps", "3")  # the default, which the helpers raise
    proc = _helpers.run_rl(tmp_path, *warm, *quiet, *stops, "--trainer.optim.lr", "1.0", timeout=600)
    assert proc.returncode != 0 and "rl: done" not in proc.stdout
    logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
    # The trainer sees the loss go non-finite, or the huge (finite) weights it published make
    # every rollout fail (the server refuses non-finite logits), or the garbage policy earns
    # nothing any more: each stops the run, saying which.
    reasons = ("diverged", "rollouts failed", "no sample to train on")
    assert any(reason in logs for reason in reasons), logs[-3000:]
    assert "would stop the same way" in proc.stdout

"""SIGKILL of each process at a random point of a step (the trainer mid-checkpoint included), then
``--resume``: no step lost or repeated, and the final weights equal an uninterrupted run's (the
trainer's case is the project's bit-exact resume test).

The run is made deterministic (on-policy, seeded sampling, one sequence at a time in the server),
so "equal" is a real check of nothing lost: a step trained twice, skipped, or resumed from
partial state would end on other weights.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from prime_composer.transport.weights import load_weights

_spec = importlib.util.spec_from_file_location(
    "e2e_launch_helpers", Path(__file__).resolve().parents[1] / "e2e" / "conftest.py"
)
assert _spec is not None and _spec.loader is not None
_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_helpers)
REPO, metric_steps, rl_command, run_rl = (
    _helpers.REPO,
    _helpers.metric_steps,
    _helpers.rl_command,
    _helpers.run_rl,
)

NUM_STEPS = 4
DETERMINISTIC = (
    "--max-steps",
    str(NUM_STEPS),
    "--max-async-level",
    "0",
    "--ckpt.interval",
    "1",
    "--orchestrator.sampling.seed",
    "7",
    "--inference.max-num-seqs",
    "1",
    "--orchestrator.eval.interval",
    "0",
    "--warmup.max-steps",
    "20",
)
MODULES = {
    "trainer": b"prime_composer.trainer.main",
    "orchestrator": b"prime_composer.orchestrator.main",
    "inference": b"prime_composer.inference.main",
}


def pid_of(process: str, output_dir: Path) -> int | None:
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if MODULES[process] in cmdline and any(str(output_dir).encode() in a for a in cmdline):
            return int(proc.name)
    return None


def wait_for(condition, launcher: subprocess.Popen, timeout: float = 600, poll: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert launcher.poll() is None, launcher.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the moment to kill never came"
        time.sleep(poll)


def checkpoint_done(output_dir: Path, step: int) -> bool:
    return (output_dir / "checkpoints" / f"step_{step}" / "STABLE").exists()  # every part committed


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run, with its SFT warm-up."""
    out = tmp_path_factory.mktemp("reference")
    proc = run_rl(out, *DETERMINISTIC)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    final = load_weights(out / "broadcasts" / f"step_{NUM_STEPS}")
    # RL did train (nonzero losses, weights moved from the warm-up's), so "equal final weights"
    # compares trained models, not untouched ones.
    losses = [
        json.loads(line)["loss/total"]
        for line in (out / "metrics" / "trainer.jsonl").read_text().splitlines()
    ]
    assert any(loss != 0.0 for loss in losses)
    start = load_file(out / "sft" / "final" / "model.safetensors")
    assert any(not torch.equal(start[k], final[k]) for k in final.keys() & start.keys())
    return out


@pytest.fixture(scope="module")
def reference(reference_run: Path) -> dict[str, torch.Tensor]:
    return load_weights(reference_run / "broadcasts" / f"step_{NUM_STEPS}")


@pytest.fixture(scope="module")
def warm_start(reference_run: Path) -> tuple[str, ...]:
    """The interrupted runs start RL from the reference's warm-up result instead of training the
    same warm-up again: the warm-up is deterministic, and an uninterrupted run started this way
    ends on the reference's weights bit for bit (measured: max difference 0.0)."""
    return ("--no-warmup.enabled", "--model.name", str(reference_run / "sft" / "final"))


def kill_and_resume(
    out: Path, victim: str, when, warm: tuple[str, ...], poll: float = 0.05, armed=None
) -> str:
    """Start a run, SIGKILL ``victim`` once ``when(out)`` says so (polled every ``poll`` s once
    ``armed(out)`` holds, every 50 ms before: a tight loop from the start would take one of two
    cores from the run), resume; returns the first output."""
    launcher = subprocess.Popen(
        rl_command(out, *DETERMINISTIC, *warm),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        if armed is not None:
            wait_for(lambda: armed(out), launcher)
        wait_for(lambda: when(out), launcher, poll=poll)
        # Inside the run: its last step is not committed yet (the kill cannot come after its end).
        assert not checkpoint_done(out, NUM_STEPS), "the run ended before the kill point"
        pid = pid_of(victim, out)
        assert pid is not None, f"no {victim} process to kill"
        os.kill(pid, signal.SIGKILL)
        output, _ = launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0, output[-2000:]
    assert f"{victim} exited with code -9" in output, output[-2000:]
    assert "--resume" in output, output[-2000:]  # the launcher says how to continue
    resumed = run_rl(out, *DETERMINISTIC, *warm, "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming" in resumed.stdout
    return output


def assert_same_run(out: Path, reference: dict[str, torch.Tensor]) -> None:
    assert metric_steps(out, "trainer") == list(range(NUM_STEPS))  # no step lost or repeated
    assert metric_steps(out, "orchestrator") == list(range(NUM_STEPS))
    final = load_weights(out / "broadcasts" / f"step_{NUM_STEPS}")
    assert final.keys() == reference.keys()
    diff = max((final[k] - reference[k]).abs().max().item() for k in final)
    assert diff <= 1e-6, diff


def metric_rows(output_dir: Path, process: str) -> int:
    path = output_dir / "metrics" / f"{process}.jsonl"
    try:
        return path.read_text().count("\n")  # whole rows only (a row is written with its newline)
    except FileNotFoundError:
        return 0


# Moments of a step, each an event the run shows in its files, not a time (so the kill cannot
# come after the run's end): step ``s``'s checkpoint committed, then its rollouts done (the
# orchestrator's row of step ``s``), then its training done (the trainer's row of step ``s``,
# before the checkpoint of step ``s + 1``). Each follows the checkpoint of step ``s``, so a
# complete checkpoint precedes the kill.
EVENTS = {
    "checkpoint": lambda out, s: checkpoint_done(out, s),
    "rollouts": lambda out, s: checkpoint_done(out, s) and metric_rows(out, "orchestrator") > s,
    "training": lambda out, s: checkpoint_done(out, s) and metric_rows(out, "trainer") > s,
}


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["trainer", "orchestrator", "inference"])
def test_sigkill_at_a_random_point_then_resume(
    tmp_path: Path, reference, warm_start, victim: str, fault_rng: random.Random
) -> None:
    # Steps 1 and 2 of 4, so that a committed checkpoint precedes the kill and steps follow it.
    step = fault_rng.choice([1, 2])
    event = fault_rng.choice(sorted(EVENTS))
    print(f"kill point: {victim} at the {event} event of step {step}")
    kill_and_resume(tmp_path, victim, lambda out: EVENTS[event](out, step), warm_start, poll=0.01)
    assert_same_run(tmp_path, reference)


@pytest.mark.slow
def test_sigkill_of_the_trainer_in_the_middle_of_a_checkpoint(tmp_path: Path, reference, warm_start) -> None:
    def mid_checkpoint(out: Path) -> bool:
        # While writing the checkpoint of step 2 or later (so an older complete one exists).
        root = out / "checkpoints"
        return checkpoint_done(out, 1) and any(
            (root / f"step_{step}" / ".trainer.tmp").exists() for step in range(2, NUM_STEPS + 1)
        )

    # A tight poll: a checkpoint of the tiny model is written in ~50 ms.
    kill_and_resume(
        tmp_path, "trainer", mid_checkpoint, warm_start, poll=0.0, armed=lambda out: checkpoint_done(out, 1)
    )
    assert_same_run(tmp_path, reference)

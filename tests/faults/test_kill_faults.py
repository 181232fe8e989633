"""SIGKILL of each process at a random point of a step (the trainer mid-checkpoint included), then
``--resume``: no step lost or repeated, and the final weights equal an uninterrupted run's (the
trainer's case is the project's bit-exact resume test). The four kills fall in one run, each in
the resumed run of the kill before (so a resume of a resumed run is checked too): two launches per
kill point were mostly process start-ups.

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

# Four kills in one run, each at most ~3 steps after the previous one's last checkpoint, leave
# steps to run after the last kill.
NUM_STEPS = 12
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
    # A step whose groups all tie is still an optimizer step (and a checkpoint): over 12 steps the
    # seeded run has 3 such steps in a row, which would stop it by default.
    "--orchestrator.failure.max-empty-steps",
    str(NUM_STEPS),
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
def warm_start(quickstart_warmup: Path) -> tuple[str, ...]:
    """Every run here starts RL from the quickstart's warm-up, trained once per test run (the
    warm-up is not what these tests kill)."""
    return ("--no-warmup.enabled", "--model.name", str(quickstart_warmup))


@pytest.fixture(scope="module")
def reference(
    tmp_path_factory: pytest.TempPathFactory, quickstart_warmup: Path, warm_start: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    """The final weights of the uninterrupted run."""
    out = tmp_path_factory.mktemp("reference")
    proc = run_rl(out, *DETERMINISTIC, *warm_start)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    final = load_weights(out / "broadcasts" / f"step_{NUM_STEPS}")
    # RL did train (nonzero losses, weights moved from the warm-up's), so "equal final weights"
    # compares trained models, not untouched ones.
    losses = [
        json.loads(line)["loss/total"]
        for line in (out / "metrics" / "trainer.jsonl").read_text().splitlines()
    ]
    assert any(loss != 0.0 for loss in losses)
    start = load_file(quickstart_warmup / "model.safetensors")
    assert any(not torch.equal(start[k], final[k]) for k in final.keys() & start.keys())
    return final


def kill_during(
    out: Path, victim: str, when, warm: tuple[str, ...], resume: bool, poll: float, armed=None
) -> None:
    """Start a run (``--resume`` of the one before if ``resume``), SIGKILL ``victim`` once
    ``when(out)`` says so (polled every ``poll`` s once ``armed(out)`` holds, every 50 ms before:
    a tight loop from the start would take one of two cores from the run)."""
    launcher = subprocess.Popen(
        rl_command(out, *DETERMINISTIC, *warm, *(("--resume",) if resume else ())),
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
    if resume:
        assert "resuming" in output, output[-2000:]


def last_committed(out: Path) -> int:
    return max((s for s in range(1, NUM_STEPS + 1) if checkpoint_done(out, s)), default=0)


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
@pytest.mark.timeout(2400)  # six launches in one test (~10 min at load 5 on 2 cores)
def test_sigkill_of_each_process_at_random_points_then_resume(
    tmp_path: Path, reference, warm_start, fault_rng: random.Random
) -> None:
    """One run killed four times, each kill followed by ``--resume`` (which the next kill
    interrupts): the trainer, the orchestrator and the inference server each at a random event of
    a random step, and the trainer in the middle of writing a checkpoint, in a random order. The
    run that finally completes must equal the uninterrupted one."""
    kills = ["trainer", "orchestrator", "inference", "mid-checkpoint"]
    fault_rng.shuffle(kills)
    for i, kill in enumerate(kills):
        # Every kill point lies after the last checkpoint the previous kill left, so it is an event
        # of this (resumed) run, not a file left by the one before.
        last = last_committed(tmp_path)
        if kill == "mid-checkpoint":
            first = last + 2  # a checkpoint of this run (``last + 1``) is complete before the kill

            def mid_checkpoint(out: Path, first: int = first) -> bool:
                root = out / "checkpoints"
                return any(
                    (root / f"step_{s}" / ".trainer.tmp").exists() for s in range(first, NUM_STEPS + 1)
                )

            print(f"kill {i}: trainer while writing a checkpoint of step {first} or later")
            # A tight poll: a checkpoint of the tiny model is written in ~50 ms.
            armed = lambda out, step=first - 1: checkpoint_done(out, step)  # noqa: E731
            kill_during(tmp_path, "trainer", mid_checkpoint, warm_start, i > 0, poll=0.0, armed=armed)
        else:
            step = last + 1 + fault_rng.choice([0, 1])
            event = fault_rng.choice(sorted(EVENTS))
            print(f"kill {i}: {kill} at the {event} event of step {step}")
            when = lambda out, event=event, step=step: EVENTS[event](out, step)  # noqa: E731
            kill_during(tmp_path, kill, when, warm_start, i > 0, poll=0.01)
    resumed = run_rl(tmp_path, *DETERMINISTIC, *warm_start, "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming" in resumed.stdout
    assert_same_run(tmp_path, reference)

"""A full disk through the whole launcher: ``output_dir`` on a 20 MB filesystem, a checkpoint
every step. The run stops when the disk fills (some process cannot write); the launcher and the
trainer agree on what can be resumed, no step holds one checkpoint part without the others, and
after space is freed ``--resume`` finishes the run with every step trained and logged once.

It used to leave the parts rotated independently (step 2 with the trainer's part only, steps 4
and 5 with the orchestrator's), so ``--resume`` found "no complete, intact checkpoint" while the
launcher had printed "No checkpoint to resume from yet". How full the disk is at the start is drawn
from the fault seed (``conftest.py``), so the disk fills at another moment of a step on each run.
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from prime_composer.checkpoint_layout import (
    MARKER_SUFFIX,
    all_steps,
    find_resume_point,
    is_committed,
    step_dir,
)

_spec = importlib.util.spec_from_file_location(
    "e2e_launch_helpers", Path(__file__).resolve().parents[1] / "e2e" / "conftest.py"
)
assert _spec is not None and _spec.loader is not None
_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_helpers)

NUM_STEPS = 6
RUN = (
    "--max-steps",
    str(NUM_STEPS),
    # No warm-up (cheap): the random model earns nothing, so its steps train on nothing, which
    # must not stop the run here; the checkpoints, weights and rollouts fill the disk all the same.
    "--no-warmup.enabled",
    "--orchestrator.failure.max-empty-steps",
    "1000",
    "--ckpt.interval",
    "1",
    "--orchestrator.eval.interval",
    "0",
    "--max-async-level",
    "1",
)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two runs of the launcher
def test_a_full_disk_stops_the_run_and_resume_finishes_it(tmp_path: Path, fault_rng: random.Random) -> None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(disk)]).returncode != 0:
        pytest.skip("mount -t tmpfs failed (no CAP_SYS_ADMIN in this container)")
    try:
        filler = fault_rng.randrange(3 << 20, 9 << 20)  # how much of the 20 MB is taken already
        (disk / "filler").write_bytes(b"\0" * filler)
        print(f"filler: {filler} bytes of 20 MiB")
        out = disk / "run"
        first = _helpers.run_rl(out, *RUN, timeout=900)
        text = first.stdout + first.stderr
        assert first.returncode != 0, f"the disk never filled up: the scenario did not happen. {text[-2000:]}"
        assert "rl: done" not in first.stdout

        root = out / "checkpoints"
        for step in all_steps(root):  # a step has every part or is not committed (pruned as a unit)
            parts = {
                p.name.removesuffix(MARKER_SUFFIX) for p in step_dir(root, step).glob(f"*{MARKER_SUFFIX}")
            }
            if is_committed(root, step):
                assert {"trainer", "orchestrator"} <= parts, (step, parts)
        try:
            point = find_resume_point(root, None)
        except Exception:
            point = None
        # The launcher and the trainer agree: a resume is offered exactly when one is possible.
        offered = "To continue:" in first.stdout
        logs = "".join(p.read_text(errors="replace")[-1500:] for p in sorted((out / "logs").glob("*.log")))
        assert offered == (point is not None), (
            f"launcher offered a resume: {offered}, checkpoint: {point}. {first.stdout[-1500:]} {logs}"
        )

        subprocess.run(["mount", "-o", "remount,size=400m", str(disk)], check=True)  # space freed
        resumed = _helpers.run_rl(out, *RUN, "--resume", timeout=900)
        text = resumed.stdout + resumed.stderr
        if point is None:  # the disk filled before the first checkpoint: nothing was lost, start again
            assert resumed.returncode != 0 and "no complete, intact checkpoint" in text, text[-2000:]
            return
        assert resumed.returncode == 0, f"not resumable after freeing space: {text[-3000:]}"
        assert f"resuming {out} from step {point.step}" in resumed.stdout
        assert _helpers.metric_steps(out, "trainer") == list(range(NUM_STEPS))  # none lost or repeated
        assert _helpers.metric_steps(out, "orchestrator") == list(range(NUM_STEPS))
    finally:
        subprocess.run(["umount", "-l", str(disk)])

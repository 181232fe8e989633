"""A full disk while a DC publishes its round (``OSError`` ENOSPC in the exchange) ends the run
with a ``RunError`` naming the path (one line at the entry point), not a traceback. Uses a tiny
tmpfs (root); skipped with the reason otherwise."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from prime_composer.config.errors import RunError
from prime_composer.diloco.loop import ShardcastOuterLoop
from prime_composer.diloco.toy import loopback_configs


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a 256 KiB tmpfs")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_during_the_outer_step_is_one_run_error_naming_the_path(
    tiny_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FULL_DISK_SECRET", "full-disk-secret")
    cfg = loopback_configs(
        2, "FULL_DISK_SECRET", sync_every=1, quantization="none", compression="none", round_deadline_s=2.0
    )[0]
    torch.manual_seed(0)
    model = torch.nn.Linear(300, 300)  # a float32 payload of 361 KB, more than the disk holds
    outer = ShardcastOuterLoop(cfg, model, None, tiny_disk, catch_up=False)
    try:
        with torch.no_grad():
            model.weight.add_(0.01)
        with pytest.raises(RunError) as caught:
            outer.after_inner_step(1, 10, skipped=False)
    finally:
        outer.close()
    message = str(caught.value)
    assert "no space left" in message and str(tiny_disk) in message and "round 0" in message
    assert "\n" not in message and caught.value.__cause__ is None and caught.value.__suppress_context__

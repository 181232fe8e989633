"""Two data centers train the quickstart through the real launcher with ``[diloco] backend =
"torchft"`` (one ``rl`` per DC, ``configs/diloco-dc-{a,b}.toml`` switched to torchft, a torchft
lighthouse on loopback), stop, and resume from their checkpoints.

Before the ``OuterLoop`` contract the trainer called ``save``/``load``/``last_metrics``, which the
torchft backend lacked, so this run failed at its first step. Checked: every outer round has both
DCs as members, both DCs log the same rounds, the resumed run continues torchft's round count
(its manager step came back from the ``diloco`` checkpoint part) instead of starting over, and
at the end both DCs hold bit-identical global weights and outer momentum."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .conftest import REPO, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

FIRST_STEPS, LAST_STEPS = 4, 6


def dc_command(name: str, output_dir: Path, ports: dict[str, int], lighthouse: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "prime_composer.launch.rl", "@", str(REPO / "configs" / f"diloco-dc-{name}.toml"),
        "--output-dir", str(output_dir),
        "--inference.port", str(free_port()),
        "--diloco.backend", "torchft", "--diloco.quantization", "none", "--no-diloco.error-feedback",
        "--diloco.port", str(ports[name]),
        "--diloco.torchft.store-port", str(free_port()),
        "--diloco.torchft.lighthouse", lighthouse,
        "--diloco.torchft.timeout-s", "600",
        # One fragment syncs every sync_every / num_fragments = 2 inner steps.
        "--diloco.sync-every", "4", "--diloco.num-fragments", "2", "--diloco.fragment-sync-delay", "0",
        "--orchestrator.eval.interval", "0", "--ckpt.interval", "0",
        "--orchestrator.batch-size", "16", "--orchestrator.group-size", "4",
        "--no-launch.progress", "--launch.health-timeout-s", "600",
        *extra,
    ]  # fmt: skip


def run_both(tmp_path: Path, ports: dict[str, int], lighthouse: str, *extra: str) -> None:
    env = {**os.environ, "DILOCO_SECRET": "a shared secret for this test"}
    procs = {
        name: subprocess.Popen(
            dc_command(name, tmp_path / name, ports, lighthouse, *extra),
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in "ab"
    }
    outputs = {name: proc.communicate(timeout=1800)[0] for name, proc in procs.items()}
    for name, proc in procs.items():
        assert proc.returncode == 0, outputs[name][-3000:]


def start_lighthouse() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            "torchft_lighthouse",
            "--bind",
            f"127.0.0.1:{port}",
            "--min_replicas",
            "2",
            "--join_timeout_ms",
            "1000",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"http://127.0.0.1:{port}"
        assert proc.poll() is None and time.monotonic() < deadline, "the lighthouse did not start"
        time.sleep(0.1)


def synced_records(output_dir: Path) -> list[dict]:
    lines = (output_dir / "metrics" / "trainer.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "diloco/round" in r]


def test_two_torchft_dcs_train_resume_and_agree(tmp_path: Path, quickstart_warmup: Path) -> None:
    # Both DCs start from the quickstart's warm-up, trained once per test run (from the random tiny
    # model every group ties at reward 0 and there is nothing to train on), as in the shardcast
    # test (test_diloco_launcher.py).
    warm = ("--no-warmup.enabled", "--model.name", str(quickstart_warmup))
    ports = {"a": free_port(), "b": free_port()}
    lighthouse, address = start_lighthouse()
    try:
        run_both(tmp_path, ports, address, *warm, "--max-steps", str(FIRST_STEPS))
        first = {name: synced_records(tmp_path / name) for name in "ab"}
        run_both(tmp_path, ports, address, *warm, "--max-steps", str(LAST_STEPS), "--resume")
    finally:
        lighthouse.kill()
        lighthouse.wait()
    records = {name: synced_records(tmp_path / name) for name in "ab"}
    for name in "ab":
        assert records[name] and all(r["diloco/num_members"] == 2 for r in records[name]), records[name]
        assert (
            "resumed from the checkpoint of step 4" in (tmp_path / name / "logs" / "trainer.log").read_text()
        )
    rounds = {name: [(r["step"], r["diloco/round"]) for r in records[name]] for name in "ab"}
    assert rounds["a"] == rounds["b"]
    # Rounds 0 and 1 before the stop (steps 1 and 3); the resumed run's first round is 2, not 0.
    assert sorted({r for _, r in rounds["a"]}) == [0, 1, 2]
    assert max(r["diloco/round"] for r in first["a"]) == 1
    states = {
        name: load_file(
            tmp_path / name / "checkpoints" / f"step_{LAST_STEPS}" / "diloco" / "state.safetensors"
        )
        for name in "ab"
    }
    shared = [k for k in states["a"] if k.startswith(("theta.", "momentum."))]
    assert shared and all(torch.equal(states["a"][k], states["b"][k]) for k in shared)
    meta = json.loads(
        (tmp_path / "a" / "checkpoints" / f"step_{LAST_STEPS}" / "diloco" / "meta.json").read_text()
    )
    assert meta["manager_step"] == 3

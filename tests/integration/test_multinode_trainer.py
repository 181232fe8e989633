"""The trainer across two "nodes" on one host: two ``rl`` invocations (``launch.nodes = 2``, 2 + 2
gloo ranks, torchrun's c10d rendezvous on loopback) train exactly like one 4-rank run, and a
two-node run resumed from its checkpoint continues exactly like the uninterrupted one.

The orchestrator is a stand-in here (``launch.processes = ["trainer"]`` on every node): it writes
the same packed batches for 4 ranks into each run directory, and the orchestrator's part of each
checkpoint the trainer writes, so the three runs train on identical data and the losses can be
compared to 1e-6 (read from ``metrics/trainer.jsonl``). While the two nodes train, every TCP
socket their processes listen on is on 127.0.0.1 (torch's stores would otherwise listen on every
interface: ``launch/torchrun.py``).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prime_composer.checkpoint_layout import DEFAULT_PARTS
from prime_composer.config.ports import free_port
from prime_composer.config.transport import TransportConfig
from prime_composer.metrics import read_metrics
from prime_composer.orchestrator.packing import pack_step
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.state import OrchestratorState
from prime_composer.transport.filesystem import FilesystemSender

NUM_RANKS = 4
MAX_STEPS = 4


def _samples(step: int) -> list[Sample]:
    rng = random.Random(step)
    out = []
    for i in range(8):
        prompt = [rng.randint(3, 400) for _ in range(rng.randint(3, 6))]
        completion = [rng.randint(3, 400) for _ in range(rng.randint(3, 6))]
        out.append(
            Sample(
                prompt_ids=prompt,
                completion_ids=completion,
                completion_logprobs=[-rng.uniform(0.5, 6.0) for _ in completion],
                completion_mask=[1] * len(completion),
                reward=float(i % 2),
                example_id=i // 2,
                group_id=i // 2,
                policy_step=step,
                advantage=rng.uniform(-1, 1),
            )
        )
    return out


def _orchestrate(output_dir: Path, num_ranks: int = NUM_RANKS) -> None:
    """What the orchestrator would leave: batches of every step, its checkpoint parts (steps 2, 4)."""
    sender = FilesystemSender(output_dir, TransportConfig(keep_last_steps=MAX_STEPS + 1))
    for step in range(MAX_STEPS):
        batches, _ = pack_step(_samples(step), 32, 1, num_ranks, pad_token_id=0)
        sender.send(step, batches)
    for step in (2, MAX_STEPS):
        OrchestratorState(step=step).save(output_dir / "checkpoints", keep=3, parts=DEFAULT_PARTS)


def _rl(output_dir: Path, *extra: str, prefix: list[str] | None = None) -> subprocess.Popen[str]:
    """``rl`` on the stand-in orchestrator's batches (``prefix``: e.g. ``ip netns exec <ns>``)."""
    argv = [
        *(prefix or []),
        sys.executable,
        "-m",
        "prime_composer.launch.rl",
        "--model.name",
        "builtin:tiny-qwen3",
        "--output-dir",
        str(output_dir),
        "--trainer.num-ranks",
        str(NUM_RANKS),
        "--trainer.num-threads",
        "1",
        "--launch.processes",
        '["trainer"]',
        "--launch.progress",
        "false",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _listeners(pids: set[int]) -> set[str]:
    """``addr:port`` of every TCP socket the processes ``pids`` (and their children) listen on."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    parents = [
        tuple(map(int, line.split()))
        for line in subprocess.run(
            ["ps", "-eo", "pid=,ppid="], capture_output=True, text=True
        ).stdout.splitlines()
    ]
    tree = set(pids)
    for _ in range(3):  # rl -> torchrun agent -> ranks (one ps per poll: the ranks share 2 cores)
        tree |= {pid for pid, ppid in parents if ppid in tree}
    found = set()
    for line in out.splitlines():
        if any(f"pid={pid}," in line for pid in tree):
            found.add(line.split()[3])
    return found


def _wait(procs: list[subprocess.Popen[str]], watch: bool = False) -> set[str]:
    """Wait for every ``rl``; returns the listening sockets seen meanwhile (``watch``)."""
    seen: set[str] = set()
    deadline = time.monotonic() + 600
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if watch:
            seen |= _listeners({p.pid for p in procs})
        time.sleep(0.5)
    for p in procs:
        if p.poll() is None:
            p.kill()
        out = p.communicate()[0]
        assert p.returncode == 0, out[-4000:]
    return seen


def _losses(output_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss/total"] for r in read_metrics(output_dir / "metrics" / "trainer.jsonl")}


def _two_nodes(output_dir: Path, *extra: str) -> set[str]:
    nodes = ["--launch.nodes", "2", "--launch.rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    procs = [_rl(output_dir, *nodes, "--launch.node-rank", str(k), *extra) for k in (1, 0)]
    return _wait(procs, watch=True)


@pytest.mark.slow
def test_two_nodes_train_and_resume_like_one_four_rank_run(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    for run in (one, two):
        _orchestrate(run)

    _wait([_rl(one, "--max-steps", str(MAX_STEPS))])
    reference = _losses(one)
    assert sorted(reference) == list(range(MAX_STEPS))
    assert len({round(v, 6) for v in reference.values()}) == MAX_STEPS  # the steps differ

    # Two nodes: 2 steps (ending with a complete checkpoint of step 2), then resumed on both.
    listening = _two_nodes(two, "--max-steps", "2")
    assert listening and all(addr.startswith("127.0.0.1:") for addr in listening), listening
    assert (two / "checkpoints" / "step_2" / "STABLE").exists()
    assert sorted(_losses(two)) == [0, 1]
    _two_nodes(two, "--max-steps", str(MAX_STEPS), "--resume")
    across = _losses(two)
    assert sorted(across) == list(range(MAX_STEPS))
    differences = {step: abs(across[step] - loss) for step, loss in reference.items()}
    print("two nodes against one 4-rank run, |loss difference| by step:", differences)
    assert max(differences.values()) <= 1e-6, (differences, across, reference)
    # Each node kept its own configs and logs beside the shared run directory.
    for k in (0, 1):
        assert (two / "nodes" / f"node-{k}" / "configs" / "trainer.json").is_file()
        assert "step 3" in (two / "nodes" / f"node-{k}" / "logs" / "trainer.log").read_text()

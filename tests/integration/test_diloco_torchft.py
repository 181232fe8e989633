"""The torchft outer loop through the ``OuterLoop`` contract: its checkpoint part resumes exactly.

One DC in this process with a lighthouse of ``min_replicas = 1`` (an outer step on one replica
is still the outer Nesterov step on its own pseudo-gradient). Trained 12 inner steps straight, and
trained 6, saved, rebuilt (a new manager, a new lighthouse: a restarted process) and loaded, then
6 more: same global weights, outer momentum and local weights, bit for bit. The old
``TorchftOuterLoop`` had no ``save``/``load``/``last_metrics``, which the trainer calls. And every
socket the backend leaves listening (torchft's ManagerServer, TCPStore, checkpoint server, gloo),
read with ``ss`` rather than the backend's own check, is on ``diloco.host``: torchft 0.2.0 binds
all interfaces unless made not to.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from prime_composer.config.diloco import DilocoConfig, TorchftConfig
from prime_composer.config.ports import free_port
from prime_composer.diloco.base import OuterLoop, build_outer_loop

pytestmark = pytest.mark.timeout(240)


@contextmanager
def lighthouse() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            "torchft_lighthouse",
            "--bind",
            f"127.0.0.1:{port}",
            "--min_replicas",
            "1",
            "--join_timeout_ms",
            "100",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120  # a loaded machine starts it slowly
        while True:  # a manager that finds no lighthouse backs off for tens of seconds
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline and proc.poll() is None, "the lighthouse did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def _config(address: str, fragment_sync_delay: int) -> DilocoConfig:
    return DilocoConfig(
        enabled=True,
        backend="torchft",
        quantization="none",
        port=free_port(),
        sync_every=4,
        num_fragments=2,
        fragment_sync_delay=fragment_sync_delay,
        fragment_update_alpha=0.5,
        torchft=TorchftConfig(lighthouse=address, timeout_s=20, store_port=free_port()),
    )


def _fresh(
    address: str, tmp_path: Path, delay: int
) -> tuple[torch.nn.Module, torch.optim.Optimizer, OuterLoop]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, optimizer, build_outer_loop(_config(address, delay), model, optimizer, tmp_path)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, outer: OuterLoop, steps: range) -> list[bool]:
    changed = []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        loss = model(torch.randn(4, 6, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        changed.append(outer.after_inner_step(step, 4, skipped=False))
    return changed


def _weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0, 1])
def test_torchft_checkpoint_part_resumes_exactly(tmp_path: Path, delay: int) -> None:
    listening_before = _listening(os.getpid())
    with lighthouse() as address:
        model, opt, outer = _fresh(address, tmp_path, delay)
        try:
            changed = _train(model, opt, outer, range(12))
            assert outer.last_metrics == {"diloco/round": 5.0, "diloco/num_members": 1.0}
            digest, weights = outer.global_digest(), _weights(model)
            # Every server torchft opened, each used by 6 outer steps, is on diloco.host only.
            _assert_listens_on_loopback_only(_listening(os.getpid()) - listening_before)
        finally:
            outer.close()
    # One fragment syncs every H/P = 2 inner steps.
    assert changed == [False, True] * 6

    with lighthouse() as address:
        model, opt, outer = _fresh(address, tmp_path, delay)
        try:
            _train(model, opt, outer, range(6))
            part = outer.save(tmp_path / "checkpoints", 6)
            model_state = {k: v.clone() for k, v in model.state_dict().items()}
            opt_state = opt.state_dict()
        finally:
            outer.close()
    assert (part / "MANIFEST.json").is_file() and (part.parent / "diloco.STABLE").is_file()

    with lighthouse() as address:
        model, opt, outer = _fresh(address, tmp_path, delay)
        try:
            model.load_state_dict(model_state)
            opt.load_state_dict(opt_state)
            outer.load(tmp_path / "checkpoints", 6)
            assert _train(model, opt, outer, range(6, 12)) == [False, True] * 3
            assert outer.global_digest() == digest
            assert torch.equal(_weights(model), weights)
        finally:
            outer.close()


def _listening(pid: int) -> set[tuple[str, int]]:
    """``(address, port)`` of the TCP sockets ``pid`` listens on, as ``ss`` (iproute2, which the
    namespace tests need too) reports them."""
    lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout.splitlines()
    found = set()
    for line in lines:
        if f"pid={pid}," in line:
            address, _, port = line.split()[3].rpartition(":")
            found.add((address.strip("[]"), int(port)))
    return found


def _assert_listens_on_loopback_only(opened: set[tuple[str, int]]) -> None:
    assert len(opened) >= 2, opened  # at least the ManagerServer and the TCPStore
    wrong = {(a, p) for a, p in opened if a not in ("127.0.0.1", "::ffff:127.0.0.1")}
    assert not wrong, f"torchft listens beyond diloco.host = 127.0.0.1: {sorted(wrong)}"


def test_every_diloco_backend_literal_is_registered() -> None:
    from typing import get_args

    from prime_composer.config.diloco import DilocoBackend
    from prime_composer.diloco.base import OUTER_LOOPS, outer_loop_class

    for name in get_args(DilocoBackend):
        outer_loop_class(name)
    assert set(OUTER_LOOPS) == set(get_args(DilocoBackend))

"""The trainer across two machines, modelled as two network namespaces joined by shaped veth links
(``infra/diloco/netsim.py``: a bridge, ``tc tbf``): node 0 (``10.77.0.1``) hosts the c10d
rendezvous, node 1 (``10.77.0.2``) joins it, one gloo rank each over the link. This is the path a
cluster takes (an endpoint off loopback, ``launch.private_network``, node 1 finding its own
address, gloo on the interface of that address), which one host's loopback never exercises.

Each namespace's listening sockets are on that namespace's address only (never a wildcard), and
the losses equal one process training on both ranks' batches in this test (an unsharded
computation, to 1e-6). The namespaces share the filesystem, which stands for the shared
``output_dir`` a cluster needs; the batches come from the stand-in orchestrator of
``test_multinode_trainer.py``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "infra" / "diloco"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from netsim import NetSim, available
from test_multinode_trainer import _losses, _orchestrate, _rl, _samples

from prime_composer.config.resolve import resolve_rl_config
from prime_composer.orchestrator.packing import pack_step

STEPS = 2
PORT = 29470
NUM_RANKS = 2
"""One rank per node: the link is what is tested (2 + 2 ranks on one host: test_multinode_trainer.py)."""


def _listening(prefix: list[str]) -> set[str]:
    out = subprocess.run([*prefix, "ss", "-ltnH"], capture_output=True, text=True, check=True).stdout
    return {line.split()[3] for line in out.splitlines() if line.strip()}


def _unsharded_losses(tmp_path: Path, flags: list[str]) -> dict[int, float]:
    """The same steps in this process: one rank training on every rank's micro-batches."""
    from prime_composer.trainer.model import World
    from prime_composer.trainer.train import Trainer

    config, _ = resolve_rl_config([*flags, "--output-dir", str(tmp_path / "unsharded")])
    trainer_config = config.trainer.model_copy(update={"num_ranks": 1})
    torch.set_num_threads(1)
    trainer = Trainer(trainer_config, World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    losses = {}
    for step in range(STEPS):
        batches, _ = pack_step(_samples(step), 32, 1, NUM_RANKS, pad_token_id=0)
        losses[step] = trainer.step([mb for rank in batches for mb in rank], step)["loss/total"]
    return losses


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.skipif(available() is not None, reason=f"network namespaces: {available()}")
def test_two_nodes_in_two_namespaces_train_like_one_process(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _orchestrate(run, NUM_RANKS)
    with NetSim(num_dcs=2, rate_mbit=200) as net:
        nodes = [
            "--launch.nodes",
            "2",
            "--launch.rdzv-endpoint",
            f"{net.address(0)}:{PORT}",
            "--launch.private-network",
            "true",
            "--max-steps",
            str(STEPS),
            "--trainer.num-ranks",
            str(NUM_RANKS),
        ]
        procs = [_rl(run, *nodes, "--launch.node-rank", str(k), prefix=net.prefix(k)) for k in (0, 1)]
        seen: list[set[str]] = [set(), set()]
        deadline = time.monotonic() + 600
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            for k in (0, 1):
                seen[k] |= _listening(net.prefix(k))
            time.sleep(0.5)
        for p in procs:
            if p.poll() is None:
                p.kill()
            out = p.communicate()[0]
            assert p.returncode == 0, out[-4000:]
    # Node 0 hosted the rendezvous on its address; no socket of either node listened anywhere else.
    assert f"{net.address(0)}:{PORT}" in seen[0], seen
    for k in (0, 1):
        assert seen[k] and all(addr.startswith(f"{net.address(k)}:") for addr in seen[k]), (k, seen)
    across = _losses(run)
    assert sorted(across) == list(range(STEPS))
    reference = _unsharded_losses(tmp_path, ["--model.name", "builtin:tiny-qwen3", "--max-steps", str(STEPS)])
    differences = {step: abs(across[step] - loss) for step, loss in reference.items()}
    print("two namespaces against one unsharded process, |loss difference| by step:", differences)
    assert max(differences.values()) <= 1e-6, (across, reference)

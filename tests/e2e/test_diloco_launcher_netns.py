"""Two data centers as two machines: one ``rl`` each, every DC in its own network namespace
(``infra/diloco/netsim.py``: a bridge, ``tc tbf`` links, and a delay proxy for latency), with its
own HOME, caches, temporary directory and output dir, and the other DC's directory hidden under an
empty tmpfs in its mount namespace: nothing is shared but TCP (and the installed code). The
origins serve pinned TLS on the namespaces' addresses; each DC reaches its peer through a proxy in
its own namespace that delays every byte. Both DCs must be members of every round and end with
bit-identical global weights, outer momentum and ``final/``.

The smallest run that shows it: no warm-up (the tiny model from each DC's own cache, built alike),
no dynamic sampling (a random model's groups would all be dropped; weight decay still moves the
weights), 2 steps with 2 fragments, so two rounds."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .conftest import REPO

sys.path.insert(0, str(REPO / "infra" / "diloco"))
from netsim import NetSim, available

from prime_composer.wire.tls import generate

pytestmark = [
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.skipif(available() is not None, reason=f"network namespaces: {available()}"),
]

NUM_STEPS = 2
ORIGIN_PORT = 7801
PROXY_PORT = 7802
DELAY_MS = 20
PROXY = (
    "import sys, time\n"
    f"sys.path.insert(0, {str(REPO / 'infra' / 'diloco')!r})\n"
    "from netsim import DelayProxy\n"
    "DelayProxy(('127.0.0.1', int(sys.argv[1])), (sys.argv[2], int(sys.argv[3])), float(sys.argv[4]))\n"
    "print('ready', flush=True)\n"
    "time.sleep(3600)\n"
)
_SHARED_ENV = ("PRIME_COMPOSER_", "HF_", "XDG_", "TORCH", "TRITON", "TMP", "TEMP")


def _env(root: Path) -> dict[str, str]:
    """This DC's environment: its own HOME, caches and temporary directory, nothing of the host's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SHARED_ENV)}
    dirs = {
        "HOME": root / "home",
        "XDG_CACHE_HOME": root / "cache",
        "XDG_CONFIG_HOME": root / "config",
        "XDG_DATA_HOME": root / "data",
        "HF_HOME": root / "cache" / "huggingface",
        "TMPDIR": root / "tmp",
    }
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    return (
        env
        | {k: str(v) for k, v in dirs.items()}
        | {
            "HF_HUB_OFFLINE": "1",
            "PYTHONDONTWRITEBYTECODE": "1",  # no write into the shared code
            "DILOCO_SECRET": "the run's secret, set in both DCs",
        }
    )


def _dc_command(i: int, net: NetSim, root: Path, other: Path, pin: str) -> list[str]:
    peer = 1 - i
    hide = 'mount -t tmpfs none "$0" && exec "$@"'  # the other DC's files do not exist here
    return [
        *net.prefix(i), "unshare", "--mount", "--propagation", "private", "sh", "-c", hide, str(other),
        sys.executable, "-m", "prime_composer.launch.rl", "@", str(REPO / "configs" / "diloco-quickstart.toml"),
        "--output-dir", str(root / "run"),
        "--inference.port", "8000",
        "--diloco.cluster-id", f"dc-{i}",
        "--diloco.host", net.address(i),
        "--diloco.port", str(ORIGIN_PORT),
        "--diloco.tls-cert", str(root / "tls" / "cert.pem"),
        "--diloco.tls-key", str(root / "tls" / "key.pem"),
        "--diloco.peers",
        f'[{{cluster_id = "dc-{peer}", urls = ["https://127.0.0.1:{PROXY_PORT}"], fingerprint = "{pin}"}}]',
        "--max-steps", str(NUM_STEPS),
        "--diloco.sync-every", "2", "--diloco.num-fragments", "2", "--diloco.fragment-sync-delay", "0",
        "--diloco.round-deadline-s", "120",
        "--no-warmup.enabled", "--orchestrator.advantage.dynamic-sampling", "false",
        "--orchestrator.eval.interval", "0", "--ckpt.interval", "0",
        "--orchestrator.batch-size", "8", "--orchestrator.group-size", "4", "--no-launch.progress",
    ]  # fmt: skip


@pytest.mark.timeout(900)
def test_two_dcs_in_two_namespaces_share_nothing_but_tcp_and_agree(tmp_path: Path) -> None:
    roots = [tmp_path / f"dc-{i}" for i in range(2)]
    pins = [generate(root / "tls", f"dc-{i}") for i, root in enumerate(roots)]  # each DC its own cert
    with NetSim(num_dcs=2, rate_mbit=50) as net:
        proxies = [
            subprocess.Popen(
                [
                    *net.prefix(i),
                    sys.executable,
                    "-c",
                    PROXY,
                    str(PROXY_PORT),
                    net.address(1 - i),
                    str(ORIGIN_PORT),
                    str(DELAY_MS),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            for i in range(2)
        ]
        try:
            for p in proxies:
                assert p.stdout is not None and p.stdout.readline().strip() == "ready"
            procs = [
                subprocess.Popen(
                    _dc_command(i, net, roots[i], roots[1 - i], pins[1 - i]),
                    cwd=REPO,  # the environments ship with the code
                    env=_env(roots[i]),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                for i in range(2)
            ]
            outputs = [p.communicate(timeout=800)[0] for p in procs]
        finally:
            for p in proxies:
                p.kill()
                p.wait()
    for i, p in enumerate(procs):
        assert p.returncode == 0, outputs[i][-3000:]
    runs = [root / "run" for root in roots]
    for i, run in enumerate(runs):
        # What each DC wrote names only its own directory (the other's was not even visible).
        for path in (run / "configs").iterdir():
            assert str(roots[1 - i]) not in path.read_text(), path
    rounds = []
    for run in runs:
        records = [json.loads(line) for line in (run / "metrics" / "trainer.jsonl").read_text().splitlines()]
        synced = [r for r in records if "diloco/round" in r]
        assert synced and all(r["diloco/num_members"] == 2 for r in synced), synced
        rounds.append([r["diloco/round"] for r in synced])
    assert rounds[0] == rounds[1] and len(rounds[0]) >= 1
    states = [
        load_file(glob.glob(str(run / "checkpoints" / f"step_{NUM_STEPS}" / "diloco" / "*.safetensors"))[0])
        for run in runs
    ]
    shared = [k for k in states[0] if k.startswith(("theta.", "momentum."))]
    assert shared and all(torch.equal(states[0][k], states[1][k]) for k in shared)
    assert any(bool(states[0][k].abs().sum() > 0) for k in shared if k.startswith("momentum."))  # it moved
    finals = [
        {
            k: v
            for f in sorted(glob.glob(str(run / "final" / "*.safetensors")))
            for k, v in load_file(f).items()
        }
        for run in runs
    ]
    assert finals[0] and finals[0].keys() == finals[1].keys()
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])

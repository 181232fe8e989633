"""Published weights reach an inference worker on another host with no shared folder, in the
network namespaces of ``infra/diloco/netsim.py``: the trainer side serves its ``broadcasts/`` with
``python -m prime_composer.transport.remote serve`` (pinned TLS) in one namespace, the worker runs
``... fetch`` in another into its own root, and what it loads equals, tensor for tensor, the tiny
model's weights the trainer published. Needs root; skipped with the reason otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "infra" / "diloco"))

from netsim import NetSim, available  # noqa: E402

from prime_composer.diloco.tls import generate  # noqa: E402
from prime_composer.transport.weights import load_weights, publish_weights  # noqa: E402

SECRET = "remote-worker-secret-5e0c"

pytestmark = [pytest.mark.netns, pytest.mark.skipif(available() is not None, reason=f"netsim {available()}")]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_worker_in_another_namespace_fetches_and_loads_the_published_step(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from prime_composer.model.resolve import resolve_model_name

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_name("builtin:tiny-qwen3"), dtype=torch.float32
    )
    with torch.no_grad():
        next(model.parameters()).add_(0.25)  # a trained step: not the weights the worker starts with
    trainer_root = tmp_path / "trainer" / "broadcasts"
    publish_weights(model, model.config, trainer_root, 7)
    expected = load_weights(trainer_root / "step_7")
    pin = generate(tmp_path / "tls", "trainer")
    env = {**os.environ, "WEIGHTS_SECRET": SECRET}
    with NetSim(num_dcs=2, rate_mbit=100) as net:
        log = open(tmp_path / "origin.log", "wb")  # noqa: SIM115
        origin = subprocess.Popen(
            [
                *net.prefix(0),
                sys.executable,
                "-m",
                "prime_composer.transport.remote",
                "serve",
                "--root",
                str(trainer_root),
                "--host",
                net.address(0),
                "--port",
                "7900",
                "--tls-cert",
                str(tmp_path / "tls" / "cert.pem"),
                "--tls-key",
                str(tmp_path / "tls" / "key.pem"),
                "--secret-env",
                "WEIGHTS_SECRET",
            ],
            env=env,
            stdout=log,
            stderr=log,
        )
        try:
            until = time.monotonic() + 60
            while b"weights origin ready" not in (tmp_path / "origin.log").read_bytes():
                assert origin.poll() is None and time.monotonic() < until, (
                    tmp_path / "origin.log"
                ).read_text()
                time.sleep(0.1)
            fetch = [
                *net.prefix(1),
                sys.executable,
                "-m",
                "prime_composer.transport.remote",
                "fetch",
                "--url",
                f"https://{net.address(0)}:7900",
                "--root",
                str(tmp_path / "worker" / "broadcasts"),
                "--secret-env",
                "WEIGHTS_SECRET",
            ]
            done = subprocess.run(
                [*fetch, "--fingerprint", pin], env=env, capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 0, done.stderr
            # Another secret: refused by the trainer side, nothing written.
            wrong = subprocess.run(
                [*fetch, "--fingerprint", pin, "--step", "7"],
                env={**env, "WEIGHTS_SECRET": "not-the-secret"},
                capture_output=True,
                text=True,
                timeout=120,
            )
        finally:
            origin.terminate()
            origin.wait(timeout=10)
    path = Path(done.stdout.strip())
    assert path == tmp_path / "worker" / "broadcasts" / "step_7"
    assert wrong.returncode == 1 and "HTTP 401" in wrong.stderr
    loaded = load_weights(path)
    assert loaded.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(loaded[k], v), k

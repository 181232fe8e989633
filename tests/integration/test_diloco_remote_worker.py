"""Published weights reach an inference worker on another host with no shared folder, in the
network namespaces of ``infra/diloco/netsim.py``: the trainer side serves its ``broadcasts/`` with
``python -m prime_composer.transport.remote serve`` (pinned TLS) in one namespace, the worker runs
``... fetch`` in another into its own root, and what it loads equals, tensor for tensor, the tiny
model's weights the trainer published. The namespace test needs root (skipped with the reason otherwise); the second runs the hf server
in this process with ``inference.weights_origin`` and drives it as the orchestrator does."""

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

from prime_composer.transport.weights import load_weights, publish_weights  # noqa: E402
from prime_composer.wire.tls import generate  # noqa: E402

SECRET = "remote-worker-secret-5e0c"

_NETNS_SKIP = pytest.mark.skipif(available() is not None, reason=f"netsim {available()}")


def _tiny_model_step(root: Path, step: int) -> dict[str, torch.Tensor]:
    """Publish the tiny model with one tensor moved (a trained step) under ``root``; its tensors."""
    from transformers import AutoModelForCausalLM

    from prime_composer.model.resolve import resolve_model_name

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_name("builtin:tiny-qwen3"), dtype=torch.float32
    )
    with torch.no_grad():
        next(model.parameters()).add_(0.25)
    publish_weights(model, model.config, root, step)
    return load_weights(root / f"step_{step}")


@pytest.mark.slow
@pytest.mark.timeout(240)
@_NETNS_SKIP
@pytest.mark.netns
def test_a_worker_in_another_namespace_fetches_and_loads_the_published_step(tmp_path: Path) -> None:
    trainer_root = tmp_path / "trainer" / "broadcasts"
    expected = _tiny_model_step(trainer_root, 7)
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
        finally:
            origin.terminate()
            origin.wait(timeout=10)
    path = Path(done.stdout.strip())
    assert path == tmp_path / "worker" / "broadcasts" / "step_7"
    loaded = load_weights(path)
    assert loaded.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(loaded[k], v), k


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_hf_server_with_a_weights_origin_takes_the_orchestrators_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import httpx

    from prime_composer.config.inference import InferenceConfig
    from prime_composer.inference.local import running_server
    from prime_composer.integrity import file_digest
    from prime_composer.transport.remote import WeightsOrigin

    trainer_root = tmp_path / "trainer" / "broadcasts"
    _tiny_model_step(trainer_root, 3)
    origin = WeightsOrigin(trainer_root, "127.0.0.1", 0, SECRET.encode())
    monkeypatch.setenv("WEIGHTS_SECRET", SECRET)
    config = InferenceConfig(
        output_dir=tmp_path / "worker",
        max_model_len=256,
        num_threads=1,
        weights_origin=f"http://127.0.0.1:{origin.port}",
        weights_secret_env="WEIGHTS_SECRET",
    )
    try:
        with running_server(config) as url, httpx.Client(base_url=url, timeout=120) as client:
            # What the orchestrator sends: the trainer's own path, which the worker does not have.
            done = client.post("/update_weights", json={"path": str(trainer_root.resolve() / "step_3")})
            assert done.status_code == 200, done.text
            served = client.get("/health").json()["weights"]
            local = (tmp_path / "worker" / "broadcasts" / "step_3").resolve()
            assert served == {"path": str(local), "step": 3}
            assert file_digest(local / "model.safetensors") == file_digest(
                trainer_root / "step_3" / "model.safetensors"
            )
            missing = client.post("/update_weights", json={"path": str(trainer_root / "step_9")})
            assert missing.status_code == 502, missing.text
            assert client.get("/health").json()["weights"]["step"] == 3
    finally:
        origin.close()
    # Both backends take it (the vllm one: tests/unit/test_vllm_admin.py).
    assert InferenceConfig(backend="vllm", weights_origin="http://127.0.0.1:1", weights_secret_env="W")
    with pytest.raises(ValueError, match="pin the certificate"):
        InferenceConfig(weights_origin="https://10.0.0.5:7900", weights_secret_env="W")
    with pytest.raises(ValueError, match="plain HTTP off loopback"):
        InferenceConfig(weights_origin="http://10.0.0.5:7900", weights_secret_env="W")

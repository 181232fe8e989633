"""Weights to a worker in another data center through a relay near it: origin -> relay -> worker
in three network namespaces of ``infra/diloco/netsim.py`` sharing nothing but TCP (no folder),
each hop pinned TLS with requests signed by keys derived from the secret. The worker cannot reach
the origin (its packets to it are rejected), so what it loads came through the relay; every byte
on the worker's link is recorded and holds neither the secret, nor the relay's key, nor a
readable piece of the weights. With the relay stopped, the worker fails with an error naming
both sources. The second test runs the whole chain as a run would: the orchestrator's calls from
the trainer's namespace to an ``hf`` inference server in the workers' data center over pinned
HTTPS, which fetches the step it is told to load through the relay. Needs root (skipped with the
reason otherwise)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "infra" / "diloco"))

from netsim import NetSim, available  # noqa: E402

from prime_composer.transport.remote import relay_key  # noqa: E402
from prime_composer.transport.weights import load_weights, publish_weights  # noqa: E402
from prime_composer.wire.tls import generate  # noqa: E402

# the workers' DC cannot reach the origin: an iptables rule in its namespace says so
_REASON = available() or (None if shutil.which("iptables") else "the iptables command is missing")

SECRET = "weights-relay-netns-secret-77d2"


def _wait_ready(proc: subprocess.Popen[bytes], log: Path, text: bytes) -> None:
    until = time.monotonic() + 60
    while text not in log.read_bytes():
        assert proc.poll() is None and time.monotonic() < until, log.read_text()
        time.sleep(0.1)


def _server(
    net: NetSim, i: int, args: list[str], env: dict[str, str], log: Path, module: str = "transport.remote"
) -> subprocess.Popen[bytes]:
    """``python -m prime_composer.<module> args`` in namespace ``i`` (``launch.relay``: ``rl relay``)."""
    with log.open("wb") as out:
        return subprocess.Popen(
            [*net.prefix(i), sys.executable, "-m", f"prime_composer.{module}", *args],
            env=env,
            stdout=out,
            stderr=out,
        )


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(_REASON is not None, reason=f"netsim {_REASON}")
@pytest.mark.netns
def test_a_worker_gets_the_weights_through_a_relay_near_it(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(11)
    state = {"model.embed.weight": torch.randn(256, 256, generator=g)}  # 256 KiB of weights
    trainer_root = tmp_path / "trainer" / "broadcasts"
    publish_weights(state, {"model_type": "toy"}, trainer_root, 4)
    origin_pin = generate(tmp_path / "origin-tls", "trainer")
    relay_pin = generate(tmp_path / "relay-tls", "relay")
    key_hex = relay_key(SECRET.encode()).hex()
    # The relay's environment has its key only; the secret is in the origin's and the worker's.
    relay_env = {k: v for k, v in os.environ.items() if k != "WEIGHTS_SECRET"} | {"RELAY_KEY": key_hex}
    env = {**os.environ, "WEIGHTS_SECRET": SECRET}
    with NetSim(num_dcs=3, rate_mbit=100) as net:
        origin_at, relay_at = f"https://{net.address(0)}:7900", f"https://{net.address(1)}:7901"
        subprocess.run(
            [*net.prefix(2), "iptables", "-A", "OUTPUT", "-d", net.address(0), "-p", "tcp", "-j", "REJECT"],
            check=True,
        )
        procs = []
        try:
            origin_args = ["serve", "--root", str(trainer_root), "--host", net.address(0), "--port", "7900"]
            origin_args += ["--tls-cert", str(tmp_path / "origin-tls" / "cert.pem")]
            origin_args += [
                "--tls-key",
                str(tmp_path / "origin-tls" / "key.pem"),
                "--secret-env",
                "WEIGHTS_SECRET",
            ]
            origin = _server(net, 0, origin_args, env, tmp_path / "origin.log")
            procs.append(origin)
            relay_args = [
                "--upstream",
                f"{origin_at}@{origin_pin}",
                "--dir",
                str(tmp_path / "relay-cache"),
            ]
            relay_args += ["--host", net.address(1), "--port", "7901", "--key-env", "RELAY_KEY"]
            relay_args += ["--tls-cert", str(tmp_path / "relay-tls" / "cert.pem")]
            relay_args += ["--tls-key", str(tmp_path / "relay-tls" / "key.pem")]
            relay = _server(net, 1, relay_args, relay_env, tmp_path / "relay.log", "launch.relay")
            procs.append(relay)
            _wait_ready(origin, tmp_path / "origin.log", b"weights origin ready")
            _wait_ready(relay, tmp_path / "relay.log", b"relay ready on")
            fetch = [*net.prefix(2), sys.executable, "-m", "prime_composer.transport.remote", "fetch"]
            fetch += ["--url", origin_at, "--fingerprint", origin_pin, "--relay", f"{relay_at}@{relay_pin}"]
            fetch += ["--root", str(tmp_path / "worker" / "broadcasts"), "--secret-env", "WEIGHTS_SECRET"]
            capture = net.capture(2, str(tmp_path / "worker-link.bin"))
            try:
                done = subprocess.run(
                    [*fetch, "--step", "4"], env=env, capture_output=True, text=True, timeout=120
                )
            finally:
                time.sleep(0.5)
                capture.terminate()
                capture.wait(timeout=10)
            assert done.returncode == 0, done.stderr
            # The relay down, and the origin unreachable from the worker: a clear error, naming both.
            relay.terminate()
            relay.wait(timeout=10)
            failed = subprocess.run(
                [*fetch, "--step", "4", "--root", str(tmp_path / "worker2")],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=10)
    path = Path(done.stdout.strip())
    assert path == tmp_path / "worker" / "broadcasts" / "step_4"
    assert torch.equal(load_weights(path)["model.embed.weight"], state["model.embed.weight"])
    assert failed.returncode == 1
    assert f"relay {relay_at}" in failed.stderr and f"origin {origin_at}" in failed.stderr, failed.stderr
    assert not (tmp_path / "worker2" / "step_4").exists()
    wire = (tmp_path / "worker-link.bin").read_bytes()
    weights = (trainer_root / "step_4" / "model.safetensors").read_bytes()
    assert len(wire) > len(weights)  # the step did cross this link
    assert SECRET.encode() not in wire and key_hex.encode() not in wire
    assert bytes.fromhex(key_hex) not in wire
    for offset in range(4096, len(weights) - 64, len(weights) // 16):
        assert weights[offset : offset + 64] not in wire  # encrypted on the way


_DRIVER = """
import asyncio, json, sys, time
from prime_composer.client.http import EndpointClient
from prime_composer.client.tls import InferenceTLS
from prime_composer.wire.auth import inference_signer

url, pin, secret, step_path = sys.argv[1:5]

async def main():
    tls, signer = InferenceTLS(fingerprint=pin), inference_signer(secret)
    async with EndpointClient(url, signer=signer, tls=tls) as admin:
        until = time.monotonic() + 120
        while not (await admin.get_json("/health")).ok:
            assert time.monotonic() < until, (await admin.get_json("/health")).error
            await asyncio.sleep(0.5)
        update = await admin.post_json("/update_weights", {"path": step_path})
        health = await admin.get_json("/health")
    async with EndpointClient(url + "/v1", signer=signer, tls=tls) as api:
        chat = await api.chat_completion(
            {"model": "builtin:tiny-qwen3", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
        )
    wrong = InferenceTLS(fingerprint="sha256:" + "0" * 64)
    async with EndpointClient(url, signer=signer, tls=wrong) as impostor_check:
        refused = await impostor_check.get_json("/health")
    print(json.dumps({"update": [update.ok, update.status, update.error], "health": health.data,
                      "chat": chat.ok, "refused": [refused.ok, refused.error_kind]}))

asyncio.run(main())
"""


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.skipif(_REASON is not None, reason=f"netsim {_REASON}")
@pytest.mark.netns
def test_an_inference_worker_loads_what_the_relay_delivers_over_a_pinned_https_link(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from prime_composer.integrity import file_digest
    from prime_composer.model.resolve import resolve_model_name

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_name("builtin:tiny-qwen3"), dtype=torch.float32
    )
    with torch.no_grad():
        next(model.parameters()).add_(0.25)  # a trained step, not the weights the worker starts from
    trainer_root = tmp_path / "trainer" / "broadcasts"
    publish_weights(model, model.config, trainer_root, 6)
    pins = {n: generate(tmp_path / f"{n}-tls", n) for n in ("origin", "relay", "worker")}
    tls = {
        n: [
            "--tls-cert",
            str(tmp_path / f"{n}-tls" / "cert.pem"),
            "--tls-key",
            str(tmp_path / f"{n}-tls" / "key.pem"),
        ]
        for n in pins
    }
    env = {
        **os.environ,
        "WEIGHTS_SECRET": SECRET,
        "INFERENCE_SECRET": "inference-" + SECRET,
        "HF_HUB_OFFLINE": "1",
    }
    relay_env = {k: v for k, v in env.items() if k != "WEIGHTS_SECRET"} | {
        "RELAY_KEY": relay_key(SECRET.encode()).hex()
    }
    with NetSim(num_dcs=3, rate_mbit=200) as net:
        origin_at, relay_at = f"https://{net.address(0)}:7900", f"https://{net.address(1)}:7901"
        worker_at = f"https://{net.address(2)}:8000"
        # the origin's port only: the orchestrator's calls come from the origin's namespace
        block = [
            "iptables",
            "-A",
            "OUTPUT",
            "-d",
            net.address(0),
            "-p",
            "tcp",
            "--dport",
            "7900",
            "-j",
            "REJECT",
        ]
        subprocess.run([*net.prefix(2), *block], check=True)
        procs = []
        try:
            origin_args = ["serve", "--root", str(trainer_root), "--host", net.address(0), "--port", "7900"]
            origin = _server(
                net,
                0,
                [*origin_args, *tls["origin"], "--secret-env", "WEIGHTS_SECRET"],
                env,
                tmp_path / "origin.log",
            )
            procs.append(origin)
            relay_args = [
                "--upstream",
                f"{origin_at}@{pins['origin']}",
                "--dir",
                str(tmp_path / "relay-cache"),
            ]
            relay_args += [
                "--host",
                net.address(1),
                "--port",
                "7901",
                "--key-env",
                "RELAY_KEY",
                *tls["relay"],
            ]
            relay = _server(net, 1, relay_args, relay_env, tmp_path / "relay.log", "launch.relay")
            procs.append(relay)
            worker_args = [
                "--model.name",
                "builtin:tiny-qwen3",
                "--max-model-len",
                "256",
                "--num-threads",
                "1",
            ]
            worker_args += ["--host", net.address(2), "--port", "8000", "--secret-env", "INFERENCE_SECRET"]
            worker_args += ["--output-dir", str(tmp_path / "worker"), *tls["worker"]]
            worker_args += [
                "--weights-origin",
                f"{origin_at}@{pins['origin']}",
                "--weights-secret-env",
                "WEIGHTS_SECRET",
            ]
            worker_args += ["--weights-relays", json.dumps([f"{relay_at}@{pins['relay']}"])]
            with (tmp_path / "worker.log").open("wb") as out:
                worker = subprocess.Popen(
                    [*net.prefix(2), sys.executable, "-m", "prime_composer.inference.main", *worker_args],
                    env=env,
                    stdout=out,
                    stderr=out,
                )
            procs.append(worker)
            _wait_ready(origin, tmp_path / "origin.log", b"weights origin ready")
            _wait_ready(relay, tmp_path / "relay.log", b"relay ready on")
            # The orchestrator's side, in the trainer's namespace: names the trainer's own path.
            driver = [*net.prefix(0), sys.executable, "-c", _DRIVER, worker_at, pins["worker"]]
            driver += [env["INFERENCE_SECRET"], str(trainer_root / "step_6")]
            done = subprocess.run(driver, env=env, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr[-3000:] + (tmp_path / "worker.log").read_text()[-3000:]
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=30)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["update"][0], (result, (tmp_path / "worker.log").read_text()[-3000:])
    served = (tmp_path / "worker" / "broadcasts" / "step_6").resolve()
    assert result["health"]["weights"] == {"path": str(served), "step": 6}
    assert file_digest(served / "model.safetensors") == file_digest(
        trainer_root / "step_6" / "model.safetensors"
    )
    assert (tmp_path / "relay-cache" / "step_6" / "STABLE").is_file()  # it came through the relay
    assert result["chat"] is True
    assert result["refused"] == [False, "connection"]
    log = (tmp_path / "worker.log").read_text()
    assert SECRET not in log and env["INFERENCE_SECRET"] not in log

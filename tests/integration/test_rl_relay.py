"""``rl relay @ relay.toml`` as a user runs it, on 127.0.0.1 with pinned TLS made by ``rl certs``:
a weights relay in front of the trainer side's origin and a second relay in front of the first
(origin -> relay -> relay -> worker); a worker fetches a step through the chain and gets exactly
what was published (every tensor equal), each relay having fetched it once. A DiLoCo relay starts
from its config too, and the older commands of both kinds run ``rl relay`` with their flags. Bad
configs are refused by ``--dry-run`` naming the key, and the relay key never appears in what it
prints."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from prime_composer.launch.relay import main as relay_main
from prime_composer.transport.remote import (
    AUDIENCE,
    RemoteWeights,
    WeightsOrigin,
    manifest_key,
    manifest_tag,
    relay_key,
    request_key,
)
from prime_composer.transport.weights import load_weights, publish_weights
from prime_composer.wire.fetch import Peer, request
from prime_composer.wire.tls import server_context

SECRET = b"rl-relay-test-secret-81c2"
RL = [sys.executable, "-m", "prime_composer.launch.rl"]


def _certs(out: Path) -> str:
    done = subprocess.run(
        [*RL, "certs", "--out", str(out), "--host", "127.0.0.1"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[0]


def _start(
    config: Path, env: dict[str, str], log: Path, command: list[str] | None = None
) -> tuple[subprocess.Popen[str], str]:
    """``rl relay @ config`` (or ``command``) and the value it prints for its clients, once it listens."""
    proc = subprocess.Popen(
        command or [*RL, "relay", "@", str(config)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
    )
    assert proc.stdout is not None
    until = time.monotonic() + 60
    while time.monotonic() < until:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            if line.startswith("relay ready on "):
                return proc, line.rsplit("= ", 1)[1].strip().strip("'")
        assert proc.poll() is None, log.read_text()
    proc.kill()
    raise AssertionError(f"the relay did not get ready: {log.read_text()}")


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed.weight": torch.randn(64, 16, generator=g),
        "lm_head.bias": torch.randn(64, generator=g),
    }


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_step_reaches_a_worker_through_two_rl_relays(tmp_path: Path) -> None:
    broadcasts = tmp_path / "trainer" / "broadcasts"
    publish_weights(_state(3), {"model_type": "toy"}, broadcasts, 3)
    origin_pin = _certs(tmp_path / "origin-tls")
    origin = WeightsOrigin(
        broadcasts,
        "127.0.0.1",
        0,
        SECRET,
        tls=server_context(tmp_path / "origin-tls" / "cert.pem", tmp_path / "origin-tls" / "key.pem"),
    )
    key_hex = relay_key(SECRET).hex()
    env = {**os.environ, "TEST_RELAY_KEY": key_hex}
    procs = []
    try:
        upstream, is_relay = f"https://127.0.0.1:{origin.port}@{origin_pin}", "false"
        clients = []
        for name in ("relay-a", "relay-b"):  # b's upstream is a
            _certs(tmp_path / f"{name}-tls")
            config = tmp_path / f"{name}.toml"
            config.write_text(
                f'kind = "weights"\nkey_env = "TEST_RELAY_KEY"\ndir = "{tmp_path / name}"\n'
                f'upstream = "{upstream}"\nupstream_is_relay = {is_relay}\n'
                f'tls_cert = "{tmp_path / name}-tls/cert.pem"\ntls_key = "{tmp_path / name}-tls/key.pem"\n'
            )
            proc, at = _start(config, env, tmp_path / f"{name}.log")
            procs.append(proc)
            assert at.startswith("https://127.0.0.1:") and "@sha256:" in at
            clients.append(at)
            upstream, is_relay = at, "true"
        url_b, pin_b = clients[1].split("@", 1)
        # A worker that knows only relay b (the origin's URL given is dead: nothing falls back to it).
        worker = RemoteWeights(
            "https://127.0.0.1:1", origin_pin, SECRET, timeout_s=60, relays=((url_b, pin_b),)
        )
        fetched = worker.fetch(3, tmp_path / "worker" / "broadcasts")
        state = load_weights(fetched)
        for name, tensor in _state(3).items():
            assert torch.equal(state[name], tensor), name
        manifest = (broadcasts / "step_3" / "MANIFEST.json").read_bytes()
        origin_tag = manifest_tag(manifest_key(SECRET), 3, manifest).encode()
        for name in ("relay-a", "relay-b"):  # each relay holds the step with the origin's own tag
            assert (tmp_path / name / "step_3" / "STABLE").is_file()
            assert (tmp_path / name / "step_3" / "MANIFEST.sig").read_bytes() == origin_tag
        for name in ("relay-a", "relay-b"):
            text = (tmp_path / f"{name}.log").read_text()
            assert key_hex not in text and SECRET.decode() not in text
            assert text.count("step 3 fetched") == 1, text
        # Relay a refuses a request signed for the origin's audience (each hop has its own).
        url_a, pin_a = clients[0].split("@", 1)
        status, _ = request(
            Peer(url_a, AUDIENCE, request_key(SECRET), pin_a), "GET", "latest", time.monotonic() + 10, 4096
        )
        assert status == 401
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            assert proc.wait(timeout=30) == 0
        origin.close()


@pytest.mark.timeout(120)
def test_a_diloco_relay_starts_from_its_config(tmp_path: Path) -> None:
    config = tmp_path / "diloco-relay.toml"
    config.write_text(f'kind = "diloco"\nkey_env = "TEST_RELAY_KEY"\ndir = "{tmp_path / "blobs"}"\n')
    env = {**os.environ, "TEST_RELAY_KEY": "ab" * 32}
    proc, at = _start(config, env, tmp_path / "relay.log")
    try:
        assert at.startswith("http://127.0.0.1:")
        import urllib.request

        with urllib.request.urlopen(f"{at}/health", timeout=10) as reply:
            assert reply.status == 200
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


@pytest.mark.timeout(120)
def test_the_older_diloco_relay_serve_command_runs_rl_relay(tmp_path: Path) -> None:
    old = [sys.executable, "-m", "prime_composer.diloco.relay", "serve", "--key-env", "TEST_RELAY_KEY"]
    old += ["--dir", str(tmp_path / "blobs"), "--max-clusters", "3", "--auth-window-s", "30"]
    env = {**os.environ, "TEST_RELAY_KEY": "ab" * 32}
    proc, at = _start(tmp_path, env, tmp_path / "relay.log", old)
    try:
        import urllib.request

        with urllib.request.urlopen(f"{at}/health", timeout=10) as reply:
            assert reply.status == 200
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    assert (tmp_path / "blobs").is_dir()
    refused = subprocess.run(
        [*old, "--host", "10.0.0.3", "--dry-run"], env=env, capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2 and "relay host = '10.0.0.3'" in refused.stderr, refused.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_older_weights_relay_command_runs_rl_relay_with_its_flags(tmp_path: Path) -> None:
    broadcasts = tmp_path / "trainer" / "broadcasts"
    publish_weights(_state(5), {"model_type": "toy"}, broadcasts, 5)
    origin = WeightsOrigin(broadcasts, "127.0.0.1", 0, SECRET)  # plain HTTP: loopback only
    old = [sys.executable, "-m", "prime_composer.transport.remote", "relay"]
    old += ["--upstream", f"http://127.0.0.1:{origin.port}", "--key-env", "TEST_RELAY_KEY"]
    old += [f"--root={tmp_path / 'cache'}", "--keep-steps", "1"]  # --root is rl relay's --dir
    env = {**os.environ, "TEST_RELAY_KEY": relay_key(SECRET).hex()}
    try:
        proc, at = _start(tmp_path, env, tmp_path / "relay.log", old)
        try:
            worker = RemoteWeights("http://127.0.0.1:1", None, SECRET, timeout_s=60, relays=((at, None),))
            state = load_weights(worker.fetch(5, tmp_path / "worker" / "broadcasts"))
        finally:
            proc.terminate()
            assert proc.wait(timeout=30) == 0
    finally:
        origin.close()
    for name, tensor in _state(5).items():
        assert torch.equal(state[name], tensor), name
    assert (tmp_path / "cache" / "step_5" / "STABLE").is_file()  # kept under --root
    # --upstream-relay is upstream_is_relay; a bad flag is refused as rl relay refuses it.
    resolved = subprocess.run(
        [*old, "--upstream-relay", "--dry-run"], env=env, capture_output=True, text=True, timeout=60
    )
    assert resolved.returncode == 0, resolved.stderr
    config = json.loads(resolved.stdout)
    assert config["kind"] == "weights" and config["upstream_is_relay"] is True
    assert config["dir"] == str(tmp_path / "cache") and config["keep_steps"] == 1
    refused = subprocess.run(
        [*old, "--host", "10.0.0.3", "--dry-run"], env=env, capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2 and "relay host = '10.0.0.3'" in refused.stderr, refused.stderr


def _dry_run(capsys: pytest.CaptureFixture[str], config: Path) -> tuple[int, str, str]:
    code = relay_main(["@", str(config), "--dry-run"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_dry_run_refuses_bad_relays_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    key_hex = "cd" * 32
    monkeypatch.setenv("TEST_RELAY_KEY", key_hex)
    base = f'key_env = "TEST_RELAY_KEY"\ndir = "{tmp_path / "cache"}"\n'
    cases = {
        'host = "10.0.0.3"\nupstream = "http://127.0.0.1:9"\n': "tls_cert and tls_key",
        'upstream = "https://10.0.0.1:9"\n': "pin its certificate",
        'upstream = "http://10.0.0.1:9"\n': "plain HTTP off loopback",
        "": "a weights relay needs the origin",
        'kind = "diloco"\nupstream = "http://10.0.0.1:9"\n': "relay upstream = 'http://10.0.0.1:9' is plain HTTP",
        'kind = "diloco"\nupstream_is_relay = true\n': "always a relay",
    }
    config = tmp_path / "relay.toml"
    for extra, message in cases.items():
        config.write_text(base + extra)
        code, _, err = _dry_run(capsys, config)
        assert code == 2 and message in err, (extra, err)
    config.write_text(base + 'upstream = "http://127.0.0.1:9"\n')
    monkeypatch.setenv("TEST_RELAY_KEY", "not hex")
    code, _, err = _dry_run(capsys, config)
    assert code == 2 and "key_env = 'TEST_RELAY_KEY'" in err and "relay-key" in err
    monkeypatch.setenv("TEST_RELAY_KEY", key_hex)
    code, out, err = _dry_run(capsys, config)
    assert code == 0, err
    assert key_hex not in out + err and '"key_env": "TEST_RELAY_KEY"' in out
    config.write_text(base + 'host = "10.0.0.3"\nprivate_network = true\nupstream = "http://10.0.0.1:9"\n')
    assert _dry_run(capsys, config)[0] == 0

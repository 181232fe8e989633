"""``rl``'s side of remote inference workers (``launch/remote.py``): it serves the run's
``broadcasts/`` with a weights origin, writes the worker config with the port it bound, prints the
workers' commands, waits for them, and refuses what cannot work. On loopback, no model; the run
across two network namespaces is ``tests/integration/test_remote_workers_netns.py``."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from prime_composer.config.errors import ConfigError, RunError
from prime_composer.config.ports import free_port
from prime_composer.config.rl import RLConfig
from prime_composer.launch import remote
from prime_composer.transport.remote import latest_step

SECRET = "remote-launch-secret-91c2"


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"status": "ok"}' if self.path == "/health" else b"no"
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _config(
    tmp_path: Path, worker_port: int, origin: dict[str, Any] | None = None, **launch: Any
) -> RLConfig:
    return RLConfig.model_validate(
        {
            "output_dir": tmp_path / "run",
            "launch": {"remote_inference": True, **launch},
            "orchestrator": {"base_url": f"http://127.0.0.1:{worker_port}/v1"},
            "transport": {
                "weights_origin": {"enabled": True, "secret_env": "TEST_WEIGHTS_SECRET", **(origin or {})}
            },
        }
    )


def test_rl_serves_the_broadcasts_and_writes_the_worker_config_with_the_bound_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TEST_WEIGHTS_SECRET", SECRET)
    worker = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=worker.serve_forever, daemon=True).start()
    config = _config(tmp_path, worker.server_address[1])
    origin = remote.start_weights_origin(config)
    try:
        assert origin is not None
        configs = tmp_path / "run" / "configs"
        written = json.loads((configs / remote.WORKER_CONFIG).read_text())
        assert written["weights_origin"] == f"http://127.0.0.1:{origin.port}"  # loopback: no TLS
        assert written["weights_secret_env"] == "TEST_WEIGHTS_SECRET"
        assert written["weights_relays"] == []
        assert (written["host"], written["port"]) == ("127.0.0.1", worker.server_address[1])
        assert SECRET not in (configs / remote.WORKER_CONFIG).read_text()
        record = json.loads((configs / remote.ORIGIN_RECORD).read_text())
        command = (
            f"uv run inference @ inference-worker.json --host 127.0.0.1 --port {worker.server_address[1]}"
        )
        assert record["workers"] == [command]
        assert command in capsys.readouterr().out
        # What a worker does with that config: ask the origin for the newest step, signed.
        url = written["weights_origin"]
        assert latest_step(url, None, SECRET.encode()) is None
        step = tmp_path / "run" / "broadcasts" / "step_4"
        step.mkdir(parents=True)
        (step / "STABLE").write_text("{}")
        assert latest_step(url, None, SECRET.encode()) == 4
        with pytest.raises(Exception, match="401"):
            latest_step(url, None, b"another secret")
    finally:
        if origin is not None:
            origin.close()
        worker.shutdown()


def test_the_relays_of_the_origin_section_reach_the_worker_config(tmp_path: Path) -> None:
    relay = "https://203.0.113.7:7901@sha256:" + "ab" * 32
    config = _config(tmp_path, 8000, {"relays": [relay]})
    worker = remote.worker_config(config, "https://10.0.0.1:7000@sha256:" + "0" * 64)
    assert worker.weights_relays == [relay]
    bad = _config(tmp_path, 8000, {"relays": ["https://203.0.113.7:7901"]})  # no pin
    with pytest.raises(ConfigError, match=r"weights_relays\[0\] = .*pin the certificate"):
        remote.worker_config(bad, "https://10.0.0.1:7000@sha256:" + "0" * 64)


def test_rl_stops_when_a_worker_never_answers_and_closes_the_origin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TEST_WEIGHTS_SECRET", SECRET)
    nobody = free_port()
    config = _config(tmp_path, nobody, health_timeout_s=1.0)
    with pytest.raises(
        RunError, match=f"did not answer .*start it with: uv run inference .* --port {nobody}"
    ):
        remote.start_weights_origin(config)
    bound = json.loads((tmp_path / "run" / "configs" / remote.WORKER_CONFIG).read_text())["weights_origin"]
    port = int(bound.rsplit(":", 1)[1])
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.1", port))


def test_what_cannot_work_with_remote_workers_is_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TEST_WEIGHTS_SECRET", raising=False)
    with pytest.raises(ConfigError, match=r"TEST_WEIGHTS_SECRET.*unset"):
        remote.check(_config(tmp_path, 1))
    monkeypatch.setenv("TEST_WEIGHTS_SECRET", SECRET)
    config = _config(tmp_path, 1)
    config.warmup.enabled = True
    with pytest.raises(ConfigError, match=r"warmup\.enabled"):
        remote.check(config)
    local = _config(tmp_path, 1)
    local.launch.remote_inference = False
    with pytest.raises(ConfigError, match="starts its own inference server"):
        remote.check(local)
    with pytest.raises(ValueError, match="advertise_host"):
        RLConfig.model_validate({"transport": {"weights_origin": {"host": "0.0.0.0"}}})
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        RLConfig.model_validate({"transport": {"weights_origin": {"tls_cert": "c.pem"}}})
    # A worker bound off loopback needs the inference secret: named, not a traceback.
    off = RLConfig.model_validate(
        {
            "launch": {"remote_inference": True},
            "orchestrator": {"base_url": "http://10.0.0.7:8000/v1", "inference_private_network": True},
            "transport": {"weights_origin": {"enabled": True, "secret_env": "TEST_WEIGHTS_SECRET"}},
        }
    )
    with pytest.raises(ConfigError, match=r"serve other machines.*inference\.secret_env"):
        remote.worker_config(off, "https://10.0.0.1:7000@sha256:" + "0" * 64)


def test_a_given_certificate_is_served_and_its_pin_written_into_the_worker_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prime_composer.wire.tls import generate

    monkeypatch.setenv("TEST_WEIGHTS_SECRET", SECRET)
    pin = generate(tmp_path / "tls", "weights-origin")
    worker = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=worker.serve_forever, daemon=True).start()
    tls = {"tls_cert": tmp_path / "tls" / "cert.pem", "tls_key": tmp_path / "tls" / "key.pem"}
    config = _config(tmp_path, worker.server_address[1], tls)
    origin = remote.start_weights_origin(config)
    try:
        assert origin is not None
        written = json.loads((tmp_path / "run" / "configs" / remote.WORKER_CONFIG).read_text())
        assert written["weights_origin"] == f"https://127.0.0.1:{origin.port}@{pin}"
        url, _, fingerprint = written["weights_origin"].partition("@")
        assert latest_step(url, fingerprint, SECRET.encode()) is None  # pinned TLS, signed
        with pytest.raises(Exception, match=r"(?i)pin|fingerprint|certificate"):
            latest_step(url, "sha256:" + "ab" * 32, SECRET.encode())
    finally:
        if origin is not None:
            origin.close()
        worker.shutdown()


def _tls_health_server(cert: Path, key: Path) -> ThreadingHTTPServer:
    from prime_composer.wire.tls import server_context

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    server.socket = server_context(cert, key).wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_https_workers_get_a_certificate_rl_makes_and_the_orchestrator_pins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import hashlib
    import ipaddress
    import ssl

    from cryptography import x509

    from prime_composer.health import wait_healthy
    from prime_composer.wire.tls import generate

    monkeypatch.setenv("TEST_WEIGHTS_SECRET", SECRET)
    values = {
        "output_dir": tmp_path / "run",
        "launch": {"remote_inference": True},
        "inference": {"secret_env": "TEST_INFERENCE_SECRET"},
        "orchestrator": {"base_url": ["https://10.0.0.7:8000/v1", "https://10.0.0.8:8000/v1"]},
        "transport": {"weights_origin": {"enabled": True, "secret_env": "TEST_WEIGHTS_SECRET"}},
    }
    config = RLConfig.model_validate(values)
    fingerprint = remote.prepare_worker_tls(config)
    cert = tmp_path / "run" / remote.WORKER_TLS_DIR / "cert.pem"
    der = ssl.PEM_cert_to_DER_cert(cert.read_text())
    assert (
        fingerprint
        == config.orchestrator.inference_tls_fingerprint
        == f"sha256:{hashlib.sha256(der).hexdigest()}"
    )
    names = x509.load_der_x509_certificate(der).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    assert {ipaddress.ip_address("10.0.0.7"), ipaddress.ip_address("10.0.0.8")} <= set(
        names.value.get_values_for_type(x509.IPAddress)
    )
    assert (cert.parent / "key.pem").stat().st_mode & 0o777 == 0o600
    assert remote.prepare_worker_tls(RLConfig.model_validate(values)) == fingerprint  # kept on a rerun

    monkeypatch.setattr(remote, "wait_for_workers", lambda _: None)  # the workers are not on this host
    origin = remote.start_weights_origin(config)
    try:
        written = json.loads((tmp_path / "run" / "configs" / remote.WORKER_CONFIG).read_text())
        assert (written["tls_cert"], written["tls_key"]) == (
            f"{remote.WORKER_TLS_DIR}/cert.pem",
            f"{remote.WORKER_TLS_DIR}/key.pem",
        )
        record = json.loads((tmp_path / "run" / "configs" / remote.ORIGIN_RECORD).read_text())
        assert record["inference_tls_fingerprint"] == fingerprint
        assert f"{tmp_path / 'run' / remote.WORKER_TLS_DIR}/ beside it" in capsys.readouterr().out
    finally:
        assert origin is not None
        origin.close()

    # A worker serving that certificate presents exactly the pinned fingerprint, and the start-up
    # wait accepts it; a worker with another certificate is not taken as up.
    worker = _tls_health_server(cert, cert.parent / "key.pem")
    generate(tmp_path / "other", "other")
    other = _tls_health_server(tmp_path / "other" / "cert.pem", tmp_path / "other" / "key.pem")
    try:
        served = ssl.PEM_cert_to_DER_cert(ssl.get_server_certificate(("127.0.0.1", worker.server_address[1])))
        assert f"sha256:{hashlib.sha256(served).hexdigest()}" == fingerprint
        context = remote._health_context(config)
        assert wait_healthy(
            f"https://127.0.0.1:{worker.server_address[1]}/health", 5, context=context
        ).healthy
        assert not wait_healthy(
            f"https://127.0.0.1:{other.server_address[1]}/health", 0.5, poll_s=0.1, context=context
        ).healthy
    finally:
        worker.shutdown()
        other.shutdown()


def test_rl_makes_no_worker_certificate_when_the_run_names_one(tmp_path: Path) -> None:
    base = {
        "output_dir": tmp_path / "run",
        "launch": {"remote_inference": True},
        "transport": {"weights_origin": {"enabled": True, "secret_env": "TEST_WEIGHTS_SECRET"}},
    }
    pinned = {"base_url": "https://10.0.0.7:8000/v1", "inference_tls_fingerprint": "sha256:" + "ab" * 32}
    for values in (
        {**base, "orchestrator": pinned},
        {
            **base,
            "orchestrator": {"base_url": "https://10.0.0.7:8000/v1"},
            "inference": {"tls_cert": "c.pem", "tls_key": "k.pem"},
        },
        {**base, "orchestrator": {"base_url": "http://10.0.0.7:8000/v1", "inference_private_network": True}},
    ):
        config = RLConfig.model_validate(values)
        assert remote.prepare_worker_tls(config) is None
        assert not (tmp_path / "run" / remote.WORKER_TLS_DIR).exists()
    assert config.orchestrator.inference_tls_fingerprint is None

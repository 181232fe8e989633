"""TLS on the link between the orchestrator and an inference server (``client/tls.py``,
``inference.tls_cert``), on 127.0.0.1.

A recording TCP proxy stands for the link between two machines: rollouts through the replica
relay and a weight update from ``PolicySync``'s client reach a guarded server over HTTPS with its
certificate pinned, and the recording holds neither the prompt, nor the route, nor the signature
header. A server with another certificate (a wrong pin, a self-signed one against the system's
CAs, a CA that did not sign it, a certificate for another host) is refused before the request is
written: the server never sees it. The real ``hf`` server serves HTTPS from ``inference.tls_cert``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from prime_composer.client.http import EndpointClient
from prime_composer.client.tls import InferenceTLS
from prime_composer.config.ports import free_port
from prime_composer.inference.guard import RequestGuard
from prime_composer.orchestrator.replicas import ReplicaPool, rollout_url
from prime_composer.wire.auth import INFERENCE_HEADER, inference_signer
from prime_composer.wire.tls import generate

SECRET = "tls-link-secret-4b8e"
PROMPT = "the-launch-codes-are-0451-in-the-prompt"


class _Proxy:
    """Forwards 127.0.0.1:<port> to ``target``; keeps every byte that crosses, both ways."""

    def __init__(self, target: int) -> None:
        self.recorded = bytearray()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._target = target
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self._target))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._forward, args=(src, dst), daemon=True).start()

    def _forward(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while chunk := src.recv(65536):
                with self._lock:
                    self.recorded.extend(chunk)
                dst.sendall(chunk)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._listener.close()


def _serve_tls(cert: Path, key: Path, seen: list[str]) -> Iterator[int]:
    async def echo(request: Request) -> JSONResponse:
        body = await request.body()
        seen.append(request.url.path)
        return JSONResponse({"path": request.url.path, "echo": json.loads(body or b"{}")})

    async def health(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "weights": {"step": 0}})

    routes = [
        Route("/health", health),
        Route("/v1/chat/completions", echo, methods=["POST"]),
        Route("/update_weights", echo, methods=["POST"]),
    ]
    app = RequestGuard(Starlette(routes=routes), secret=SECRET, max_body_bytes=2**20)
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", ssl_certfile=str(cert), ssl_keyfile=str(key)
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the TLS server did not start"
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def self_signed(tmp_path: Path) -> Iterator[tuple[int, str, list[str]]]:
    pin = generate(tmp_path / "tls", "inference-0", hosts=("127.0.0.1",))
    seen: list[str] = []
    yield from (
        (port, pin, seen)
        for port in _serve_tls(tmp_path / "tls" / "cert.pem", tmp_path / "tls" / "key.pem", seen)
    )


async def _chat(base_url: str) -> httpx.Response:
    chat = {"model": "m", "messages": [{"role": "user", "content": PROMPT}]}
    async with httpx.AsyncClient() as client:  # verifiers' OpenAI client, to the loopback relay
        return await client.post(
            f"{base_url}/chat/completions",
            content=json.dumps(chat).encode(),
            headers={"Authorization": f"Bearer {SECRET}", "Content-Type": "application/json"},
        )


def test_the_link_is_encrypted_and_the_pinned_certificate_is_checked(self_signed) -> None:  # type: ignore[no-untyped-def]
    port, pin, seen = self_signed
    proxy = _Proxy(port)
    remote = f"https://127.0.0.1:{proxy.port}"
    signer = inference_signer(SECRET)
    pool = ReplicaPool([remote + "/v1"], signer=signer, tls=InferenceTLS(fingerprint=pin))

    async def orchestrator() -> tuple[httpx.Response, int]:
        async with pool, rollout_url(pool) as base_url:
            assert base_url.startswith("http://127.0.0.1:")  # the relay, which checks the pin
            answer = await _chat(base_url)
        async with EndpointClient(remote, signer=signer, tls=pool.tls) as admin:  # PolicySync's
            update = await admin.post_json("/update_weights", {"path": "/run/broadcasts/step_1"})
        return answer, update.status or 0

    answer, update_status = asyncio.run(orchestrator())
    assert answer.status_code == 200, answer.text
    assert answer.json()["echo"]["messages"][0]["content"] == PROMPT
    assert update_status == 200
    assert seen == ["/v1/chat/completions", "/update_weights"]
    time.sleep(0.2)
    proxy.close()
    wire = bytes(proxy.recorded)
    assert len(wire) > 1000 and wire[0] == 0x16  # a TLS handshake record, then ciphertext
    for plain in (PROMPT.encode(), b"update_weights", b"step_1", INFERENCE_HEADER.encode(), SECRET.encode()):
        assert plain not in wire, plain


@pytest.mark.slow
def test_a_wrong_certificate_is_refused_before_anything_is_sent(self_signed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    port, pin, seen = self_signed
    other_pin = generate(tmp_path / "other", "impostor")
    url = f"https://127.0.0.1:{port}"
    signer = inference_signer(SECRET)

    async def calls() -> list:  # type: ignore[type-arg]
        results = []
        for tls in (InferenceTLS(fingerprint=other_pin), None):  # a wrong pin; the system's CAs
            async with EndpointClient(url, signer=signer, tls=tls) as client:
                results.append(await client.post_json("/update_weights", {"path": "step_1"}))
        pool = ReplicaPool([url + "/v1"], signer=signer, tls=InferenceTLS(fingerprint=other_pin))
        async with pool, rollout_url(pool) as base_url:
            results.append(await _chat(base_url))
        return results

    pinned, system, relayed = asyncio.run(calls())
    assert not pinned.ok and pinned.error_kind == "connection"
    assert other_pin in pinned.error and "refusing to send it anything" in pinned.error
    assert not system.ok and system.error_kind == "connection" and "CERTIFICATE_VERIFY_FAILED" in system.error
    assert relayed.status_code >= 500  # the relay could reach no replica it trusts
    assert seen == []  # the server never saw a request

    # The right pin, for contrast, is served.
    async def right() -> bool:
        async with EndpointClient(url, signer=signer, tls=InferenceTLS(fingerprint=pin)) as client:
            return (await client.post_json("/update_weights", {"path": "step_1"})).ok

    assert asyncio.run(right()) and seen == ["/update_weights"]


def _ca_and_leaf(out: Path, host: str) -> None:
    """``out/ca.pem`` (a CA) and ``out/cert.pem`` + ``out/key.pem`` (a leaf for ``host`` it signed)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    out.mkdir(parents=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"test CA {out.name}")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]), critical=False
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    (out / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (out / "cert.pem").write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    (out / "key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )


@pytest.mark.slow
def test_a_ca_given_in_config_is_checked_with_the_hostname(tmp_path: Path) -> None:
    _ca_and_leaf(tmp_path / "good", "127.0.0.1")
    _ca_and_leaf(tmp_path / "stranger", "127.0.0.1")
    _ca_and_leaf(tmp_path / "elsewhere", "10.9.9.9")
    signer = inference_signer(SECRET)

    def call(served: str, ca: str) -> tuple[bool, str | None, list[str]]:
        seen: list[str] = []

        async def once(port: int) -> tuple[bool, str | None]:
            tls = InferenceTLS(ca=tmp_path / ca / "ca.pem")
            async with EndpointClient(f"https://127.0.0.1:{port}", signer=signer, tls=tls) as client:
                result = await client.post_json("/update_weights", {"path": "step_1"})
            return result.ok, result.error

        for port in _serve_tls(tmp_path / served / "cert.pem", tmp_path / served / "key.pem", seen):
            ok, error = asyncio.run(once(port))
        return ok, error, seen

    assert call("good", "good") == (True, None, ["/update_weights"])
    ok, error, seen = call("good", "stranger")  # another CA
    assert not ok and "CERTIFICATE_VERIFY_FAILED" in (error or "") and seen == []
    ok, error, seen = call("elsewhere", "elsewhere")  # the right CA, a certificate for another host
    assert not ok and "CERTIFICATE_VERIFY_FAILED" in (error or "") and seen == []


def test_tls_settings_are_checked_where_they_are_given(tmp_path: Path) -> None:
    from prime_composer.config.inference import InferenceConfig
    from prime_composer.config.orchestrator import OrchestratorConfig
    from prime_composer.inference.hf.server import serve

    pin = generate(tmp_path / "tls", "x")
    fields = {"base_url": "https://10.0.0.2:8000/v1"}
    assert (
        OrchestratorConfig(**fields, inference_tls_fingerprint=pin.upper()).inference_tls_fingerprint == pin
    )
    with pytest.raises(ValueError, match="not both"):
        OrchestratorConfig(**fields, inference_tls_fingerprint=pin, inference_tls_ca=tmp_path / "ca.pem")
    with pytest.raises(ValueError, match="not a SHA-256 certificate fingerprint"):
        OrchestratorConfig(**fields, inference_tls_fingerprint="sha256:abc")
    with pytest.raises(ValueError, match=r"no orchestrator\.base_url is https://"):
        OrchestratorConfig(base_url="http://10.0.0.2:8000/v1", inference_tls_fingerprint=pin)
    with pytest.raises(ValueError, match=r"tls_cert and inference\.tls_key go together"):
        InferenceConfig(tls_cert=tmp_path / "tls" / "cert.pem")
    # both backends serve HTTPS (vLLM through --ssl-certfile / --ssl-keyfile)
    keys = {"tls_cert": tmp_path / "tls" / "cert.pem", "tls_key": tmp_path / "tls" / "key.pem"}
    assert (
        InferenceConfig(backend="vllm", host="10.0.0.2", secret_env="S", **keys).tls_cert == keys["tls_cert"]
    )
    with pytest.raises(ValueError, match=r"inference\.host = '10\.0\.0\.2' .* plain HTTP"):
        InferenceConfig(backend="vllm", host="10.0.0.2", secret_env="S")
    # A key that does not load: said at once, naming the keys, before the model is loaded.
    (tmp_path / "bad.pem").write_text("not a key")
    with pytest.raises(ValueError, match=r"inference.tls_cert = .* inference.tls_key = .*bad.pem"):
        serve(InferenceConfig(tls_cert=tmp_path / "tls" / "cert.pem", tls_key=tmp_path / "bad.pem"))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_hf_server_serves_https_from_its_config(tmp_path: Path) -> None:
    pin = generate(tmp_path / "tls", "inference", hosts=("127.0.0.1",))
    port = free_port()
    env = {**os.environ, "INFERENCE_SECRET": SECRET, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "prime_composer.inference.main", "--model.name", "builtin:tiny-qwen3"]
    command += ["--port", str(port), "--max-model-len", "256", "--num-threads", "1"]
    command += ["--secret-env", "INFERENCE_SECRET", "--output-dir", str(tmp_path / "run")]
    command += [
        "--tls-cert",
        str(tmp_path / "tls" / "cert.pem"),
        "--tls-key",
        str(tmp_path / "tls" / "key.pem"),
    ]
    log = tmp_path / "inference.log"
    with log.open("wb") as out:
        server = subprocess.Popen(command, env=env, stdout=out, stderr=out)
    url = f"https://127.0.0.1:{port}"
    signer = inference_signer(SECRET)

    async def drive() -> tuple[object, object]:
        async with EndpointClient(url, signer=signer, tls=InferenceTLS(fingerprint=pin)) as client:
            until = time.monotonic() + 180
            while not (await client.get_json("/health")).ok:
                assert server.poll() is None and time.monotonic() < until, log.read_text()[-3000:]
                await asyncio.sleep(0.5)
            chat = {
                "model": "builtin:tiny-qwen3",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
            }
        async with EndpointClient(f"{url}/v1", signer=signer, tls=InferenceTLS(fingerprint=pin)) as client:
            answer = await client.chat_completion(chat)
        async with EndpointClient(
            url, signer=signer, tls=InferenceTLS(fingerprint="sha256:" + "0" * 64)
        ) as client:
            refused = await client.get_json("/health")
        return answer, refused

    try:
        answer, refused = asyncio.run(drive())
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert answer.ok, answer.error  # type: ignore[attr-defined]
    assert not refused.ok and refused.error_kind == "connection"  # type: ignore[attr-defined]
    text = log.read_text()
    assert f"serving builtin:tiny-qwen3 on https://127.0.0.1:{port}" in text and pin in text
    assert SECRET not in text

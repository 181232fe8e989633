"""The shared secret and the request guard (inference/auth.py, inference/guard.py).

Who needs a secret, that every route but ``/health`` checks it, and the body-size limit, on a
small Starlette app standing for either backend.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocket, WebSocketDisconnect

from prime_composer.config.inference import InferenceConfig
from prime_composer.inference.auth import bearer_error, is_loopback, resolve_admin_secret
from prime_composer.inference.guard import RequestGuard
from prime_composer.wire.auth import INFERENCE_HEADER, Signer, hkdf_sha256, inference_signer, transport_key

SECRET = "s3cret-value"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.5", "::1", "[::1]", "localhost"])
def test_loopback_hosts(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "192.168.0.7", "inference.example"])
def test_non_loopback_hosts(host):
    assert not is_loopback(host)


def test_public_bind_without_secret_is_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"inference\.secret_env"):
        resolve_admin_secret("0.0.0.0", None)
    monkeypatch.delenv("PC_TEST_SECRET", raising=False)
    with pytest.raises(ValueError, match=r"inference\.secret_env = 'PC_TEST_SECRET'.*unset"):
        resolve_admin_secret("0.0.0.0", "PC_TEST_SECRET")


def test_secret_resolution(monkeypatch):
    assert resolve_admin_secret("127.0.0.1", None) is None
    monkeypatch.setenv("PC_TEST_SECRET", "s3cret-value")
    assert resolve_admin_secret("0.0.0.0", "PC_TEST_SECRET") == "s3cret-value"
    assert resolve_admin_secret("127.0.0.1", "PC_TEST_SECRET") == "s3cret-value"


def test_build_app_fails_before_loading_the_model(monkeypatch):
    from prime_composer.inference.hf.server import build_app

    monkeypatch.setenv("PC_TEST_SECRET", "")
    config = InferenceConfig(
        host="0.0.0.0",
        secret_env="PC_TEST_SECRET",
        private_network=True,
        model={"name": "builtin:does-not-exist"},
    )
    # The secret is checked first: the (invalid) model name is never reached.
    with pytest.raises(ValueError, match=r"inference\.secret_env"):
        build_app(config)


def test_bearer_error():
    assert bearer_error("Bearer right", "right") is None
    assert bearer_error("bearer  right ", "right") is None  # scheme case and spaces do not matter
    for header, message in [
        (None, "missing"),
        ("", "missing"),
        ("Basic right", "missing"),
        ("Bearer", "missing"),
        ("right", "missing"),
        ("Bearer wrong", "wrong"),
        ("Bearer righ", "wrong"),
        ("Bearer rightt", "wrong"),
        ("Bearer \udcff", "wrong"),  # undecodable header bytes do not crash the comparison
    ]:
        refusal = bearer_error(header, "right")
        assert refusal is not None and message in refusal, header
        assert "right" not in refusal  # the secret is never echoed


def _guarded_client(
    secret: str | None,
    max_body_bytes: int = 1024,
    peer: str = "127.0.0.1",
    **options: Any,
) -> TestClient:
    """The guard around an echo app, called from ``peer`` (loopback unless told)."""

    async def echo(request: Request) -> JSONResponse:
        body = await request.body()
        return JSONResponse({"path": request.url.path, "num_bytes": len(body)})

    async def socket(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.send_text("hello")
        await websocket.close()

    routes = [
        Route(p, echo, methods=["GET", "POST"]) for p in ("/health", "/v1/models", "/v1/chat/completions")
    ]
    app = Starlette(routes=[*routes, WebSocketRoute("/ws", socket)])
    guarded = RequestGuard(app, secret=secret, max_body_bytes=max_body_bytes, **options)
    return TestClient(guarded, client=(peer, 50000))


def test_every_route_but_health_needs_the_secret():
    client = _guarded_client(SECRET)
    auth = {"Authorization": f"Bearer {SECRET}"}
    assert client.get("/health").status_code == 200
    for path in ("/v1/models", "/v1/chat/completions", "/update_weights", "/docs", "/no-such-route"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": SECRET}):
            response = client.post(path, headers=headers)
            assert response.status_code == 401, (path, headers)
            assert response.json()["error"]["code"] == 401 and SECRET not in response.text
    assert client.post("/v1/chat/completions", headers=auth).json()["path"] == "/v1/chat/completions"
    assert client.get("/no-such-route", headers=auth).status_code == 404  # past the guard
    with pytest.raises(WebSocketDisconnect) as closed, client.websocket_connect("/ws") as ws:
        ws.receive_text()
    assert closed.value.code == 1008
    with client.websocket_connect("/ws", headers=auth) as ws:
        assert ws.receive_text() == "hello"


def _signer() -> Signer:
    signer = inference_signer(SECRET)
    assert signer is not None
    return signer


def test_bearer_from_another_machine_is_refused_unless_the_network_is_private():
    auth = {"Authorization": f"Bearer {SECRET}"}
    remote = _guarded_client(SECRET, peer="10.0.0.9")
    response = remote.post("/v1/chat/completions", headers=auth)
    assert response.status_code == 401
    message = response.json()["error"]["message"]
    assert "only from this machine" in message and "inference.private_network" in message
    assert SECRET not in response.text
    private = _guarded_client(SECRET, peer="10.0.0.9", private_network=True)
    assert private.post("/v1/chat/completions", headers=auth).json()["path"] == "/v1/chat/completions"
    assert private.post("/v1/chat/completions", headers={"Authorization": "Bearer no"}).status_code == 401


def test_signed_requests_pass_from_anywhere_and_replays_do_not():
    client = _guarded_client(SECRET, peer="10.0.0.9")
    signer = _signer()
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    url = "http://testserver/v1/chat/completions"
    headers = signer.headers("POST", url, body)
    assert SECRET not in json.dumps(headers)
    first = client.post("/v1/chat/completions", content=body, headers=headers)
    assert first.status_code == 200 and first.json() == {
        "path": "/v1/chat/completions",
        "num_bytes": len(body),
    }
    replayed = client.post("/v1/chat/completions", content=body, headers=headers)
    assert replayed.status_code == 401 and "replayed" in replayed.json()["error"]["message"]
    # A fresh signature for every request: a GET, and the query string is covered too.
    get = signer.headers("GET", "http://testserver/v1/models?x=1", b"")
    assert client.get("/v1/models?x=1", headers=get).status_code == 200
    wrong_query = signer.headers("GET", "http://testserver/v1/models?x=1", b"")
    assert client.get("/v1/models?x=2", headers=wrong_query).status_code == 401
    # The signature covers the body and the path: altered, it is refused.
    altered = signer.headers("POST", url, body)
    assert client.post("/v1/chat/completions", content=body + b" ", headers=altered).status_code == 401
    moved = signer.headers("POST", url, body)
    assert client.post("/update_weights", content=body, headers=moved).status_code == 401
    with client.websocket_connect("/ws", headers=signer.headers("GET", "ws://testserver/ws", b"")) as ws:
        assert ws.receive_text() == "hello"


def test_signatures_of_other_keys_times_and_servers_are_refused():
    client = _guarded_client(SECRET, peer="10.0.0.9", audience="10.0.0.2:8000")
    url = "http://10.0.0.2:8000/v1/models"
    assert client.get("/v1/models", headers=_signer().headers("GET", url, b"")).status_code == 200
    other_server = _signer().headers("GET", "http://10.0.0.3:8000/v1/models", b"")
    response = client.get("/v1/models", headers=other_server)
    assert (
        response.status_code == 401 and "addressed to '10.0.0.3:8000'" in response.json()["error"]["message"]
    )
    # DiLoCo's transport key, the raw secret as a key, another secret: all refused.
    for key in (
        transport_key(SECRET.encode()),
        SECRET.encode(),
        hkdf_sha256(b"another", b"prime-composer inference requests v1"),
    ):
        headers = Signer(key).headers("GET", url, b"")
        assert client.get("/v1/models", headers=headers).status_code == 401
    # Captured, then sent after the window: refused by its timestamp even though its nonce is new.
    from prime_composer.wire.auth import inference_key, sign_request

    stale = sign_request(
        inference_key(SECRET), "GET", "/v1/models", b"", "10.0.0.2:8000", now=time.time() - 600
    )
    response = client.get("/v1/models", headers={INFERENCE_HEADER: stale})
    assert response.status_code == 401 and "timestamp" in response.json()["error"]["message"]


def test_signed_body_over_the_limit_is_413():
    client = _guarded_client(SECRET, max_body_bytes=1024, peer="10.0.0.9")
    url = "http://testserver/v1/chat/completions"
    body = b"x" * 1025
    response = client.post("/v1/chat/completions", content=body, headers=_signer().headers("POST", url, body))
    assert response.status_code == 413

    def chunks():
        for _ in range(10):
            yield b"x" * 300

    headers = _signer().headers("POST", url, b"x" * 3000)
    response = client.post("/v1/chat/completions", content=chunks(), headers=headers)
    assert response.status_code == 413


def test_no_secret_configured_leaves_routes_open():
    client = _guarded_client(None)
    assert client.post("/v1/chat/completions").status_code == 200
    assert client.get("/v1/models").status_code == 200


def test_body_limit_with_and_without_content_length():
    client = _guarded_client(None, max_body_bytes=1024)
    assert client.post("/v1/chat/completions", content=b"x" * 1024).json()["num_bytes"] == 1024
    response = client.post("/v1/chat/completions", content=b"x" * 1025)
    assert response.status_code == 413
    assert "inference.max_request_bytes = 1024" in response.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(10):
            yield b"x" * 300

    response = client.post("/v1/chat/completions", content=chunks())
    assert response.status_code == 413 and response.json()["error"]["code"] == 413


def test_apps_built_without_a_config_use_the_config_default_limit():
    from prime_composer.inference.guard import DEFAULT_MAX_BODY_BYTES

    assert InferenceConfig().max_request_bytes == DEFAULT_MAX_BODY_BYTES == 8 * 2**20

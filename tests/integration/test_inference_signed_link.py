"""What crosses the link between the orchestrator and an inference server guarded by a secret.

A recording TCP proxy on 127.0.0.1 stands for the link between two machines: the orchestrator's
calls (rollouts through the replica relay, which OpenAI clients reach with the secret as a bearer
token on loopback, and a weight update from ``PolicySync``'s client) go through it to a real
server behind ``guard.RequestGuard``. Every byte is recorded; the recording holds neither the
secret nor a bearer token, and each recorded request sent again, byte for byte, is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from prime_composer.client.http import EndpointClient
from prime_composer.config.orchestrator import ReplicasConfig
from prime_composer.config.ports import free_port
from prime_composer.inference.guard import RequestGuard
from prime_composer.orchestrator.replicas import ReplicaPool, ReplicaRouter, rollout_url
from prime_composer.wire.auth import INFERENCE_HEADER, inference_signer

SECRET = "link-secret-9f3e1c7a"


class RecordingProxy:
    """Forwards 127.0.0.1:<port> to ``target`` and keeps every byte sent towards it."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.sent: list[bytes] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            record = bytearray()
            with self._lock:
                self.sent.append(b"")
                index = len(self.sent) - 1

            def forward(
                src: socket.socket,
                dst: socket.socket,
                keep: bool,
                index: int = index,
                record: bytearray = record,
            ) -> None:
                with contextlib.suppress(OSError):
                    while chunk := src.recv(65536):
                        if keep:
                            record.extend(chunk)
                            with self._lock:
                                self.sent[index] = bytes(record)
                        dst.sendall(chunk)
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)

            threading.Thread(target=forward, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=forward, args=(upstream, client, False), daemon=True).start()

    def close(self) -> None:
        self._listener.close()


@pytest.fixture
def guarded_server() -> Iterator[int]:
    async def echo(request: Request) -> JSONResponse:
        body = await request.body()
        return JSONResponse({"path": request.url.path, "num_bytes": len(body)})

    async def health(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "weights": {"step": 0}})

    routes = [
        Route("/health", health),
        Route("/v1/chat/completions", echo, methods=["POST"]),
        Route("/update_weights", echo, methods=["POST"]),
    ]
    app = RequestGuard(Starlette(routes=routes), secret=SECRET, max_body_bytes=2**20)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the guarded server did not start"
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(timeout=10)


def _requests(stream: bytes) -> list[bytes]:
    """The HTTP/1.1 requests in one recorded connection (each with its Content-Length body)."""
    out = []
    while stream:
        head, sep, rest = stream.partition(b"\r\n\r\n")
        assert sep, stream[:200]
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        out.append(head + sep + rest[:length])
        stream = rest[length:]
    return out


def test_no_secret_and_nothing_replayable_on_the_link(guarded_server: int) -> None:
    proxy = RecordingProxy(("127.0.0.1", guarded_server))
    remote_url = f"http://127.0.0.1:{proxy.port}"
    signer = inference_signer(SECRET)
    pool = ReplicaPool([remote_url + "/v1"], ReplicasConfig(), signer=signer)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}

    async def orchestrator() -> tuple[list[int], int]:
        statuses = []
        async with pool, ReplicaRouter(pool) as base_url, httpx.AsyncClient() as client:
            # What verifiers' OpenAI client does: the secret as its API key, to the loopback relay.
            for _ in range(3):
                response = await client.post(
                    f"{base_url}/chat/completions",
                    content=json.dumps(chat).encode(),
                    headers={"Authorization": f"Bearer {SECRET}", "Content-Type": "application/json"},
                )
                statuses.append(response.status_code)
            assert response.json() == {"path": "/v1/chat/completions", "num_bytes": len(json.dumps(chat))}
        async with EndpointClient(remote_url, signer=signer) as admin:  # PolicySync's client
            update = await admin.post_json("/update_weights", {"path": "/run/broadcasts/step_1"})
        return statuses, update.status or 0

    statuses, update_status = asyncio.run(orchestrator())
    assert statuses == [200, 200, 200] and update_status == 200
    time.sleep(0.2)  # the forwarding threads hand over their last bytes
    proxy.close()
    recorded = b"".join(proxy.sent)
    requests = [r for stream in proxy.sent for r in _requests(stream)]
    assert len(requests) == 4, [r[:60] for r in requests]
    assert SECRET.encode() not in recorded
    assert b"authorization" not in recorded.lower() and b"bearer" not in recorded.lower()
    assert all(INFERENCE_HEADER.lower().encode() in r.lower() for r in requests)

    # Each recorded request, sent again byte for byte: refused as a replay.
    for raw in requests:
        with socket.create_connection(("127.0.0.1", guarded_server), timeout=10) as sock:
            sock.sendall(raw)
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
        assert b"replayed request" in answer


def test_one_remote_server_with_a_signer_is_reached_through_the_relay() -> None:
    signer = inference_signer(SECRET)

    async def url_of(pool: ReplicaPool) -> str:
        async with rollout_url(pool) as url:
            return url

    remote = ReplicaPool(["http://10.0.0.2:8000/v1"], signer=signer)
    assert asyncio.run(url_of(remote)).startswith("http://127.0.0.1:")
    # Loopback, or no secret: called directly, as before.
    assert asyncio.run(url_of(ReplicaPool(["http://127.0.0.1:8000/v1"], signer=signer))) == (
        "http://127.0.0.1:8000/v1"
    )
    assert asyncio.run(url_of(ReplicaPool(["http://10.0.0.2:8000/v1"]))) == "http://10.0.0.2:8000/v1"

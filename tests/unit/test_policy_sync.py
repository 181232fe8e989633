"""PolicySync: waits for the weights a step needs, loads the newest into the server, signs the call
(the secret itself is never sent)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from prime_composer.orchestrator.policy import PolicySync, WeightSyncError
from prime_composer.wire.auth import Verifier, inference_key


class FakeServer:
    def __init__(self, status: int = 200) -> None:
        self.calls: list[tuple[str, dict, str | None]] = []
        self.signatures: list[str | None] = []
        calls, code, signatures = self.calls, status, self.signatures

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                calls.append((self.path, body, self.headers.get("Authorization")))
                signatures.append(self.headers.get("X-Prime-Composer-Auth"))
                self.send_response(code)
                self.end_headers()
                self.wfile.write(b'{"ok": true}')

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def server() -> Iterator[FakeServer]:
    fake = FakeServer()
    yield fake
    fake.httpd.shutdown()


def publish(root: Path, step: int, stable: bool = True) -> Path:
    path = root / f"step_{step}"
    path.mkdir(parents=True)
    if stable:
        (path / "STABLE").write_text("")
    return path


def test_base_weights_need_no_update(tmp_path: Path, server: FakeServer) -> None:
    sync = PolicySync(tmp_path, server.url, poll_s=0.01, timeout_s=1)
    assert asyncio.run(sync.ensure(0)) == 0
    assert server.calls == []


def test_loads_the_newest_stable_weights(
    tmp_path: Path, server: FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MY_SECRET", "s3cret")
    publish(tmp_path, 1)
    newest = publish(tmp_path, 2)
    publish(tmp_path, 3, stable=False)  # being written: not yet usable
    sync = PolicySync(tmp_path, server.url, secret_env="MY_SECRET", poll_s=0.01, timeout_s=1)
    assert asyncio.run(sync.ensure(1)) == 2
    # No bearer token: a signature the server checks with the key derived from the secret.
    assert server.calls == [("/update_weights", {"path": str(newest.resolve())}, None)]
    port = server.url.split(":")[2].split("/")[0]
    body = json.dumps({"path": str(newest.resolve())}).encode()
    verifier = Verifier(inference_key("s3cret"), f"127.0.0.1:{port}")
    (signature,) = server.signatures
    assert signature is not None and "s3cret" not in signature
    assert verifier.check("POST", "/update_weights", body, signature) is None
    assert (
        verifier.check("POST", "/update_weights", body, signature) == "replayed request (nonce already seen)"
    )


def test_waits_until_the_trainer_publishes(tmp_path: Path, server: FakeServer) -> None:
    sync = PolicySync(tmp_path, server.url, poll_s=0.01, timeout_s=5)

    async def scenario() -> int:
        task = asyncio.create_task(sync.ensure(1))
        await asyncio.sleep(0.2)
        assert not task.done()  # step 1's weights do not exist yet
        publish(tmp_path, 1)
        return await task

    assert asyncio.run(scenario()) == 1


def test_times_out_with_a_clear_error(tmp_path: Path, server: FakeServer) -> None:
    sync = PolicySync(tmp_path, server.url, poll_s=0.01, timeout_s=0.1)
    with pytest.raises(WeightSyncError, match="is the trainer running"):
        asyncio.run(sync.ensure(1))


def test_refused_update_is_an_error(tmp_path: Path) -> None:
    fake = FakeServer(status=403)
    publish(tmp_path, 1)
    try:
        sync = PolicySync(tmp_path, fake.url, poll_s=0.01, timeout_s=1)
        with pytest.raises(WeightSyncError, match="http_403"):
            asyncio.run(sync.ensure(1))
    finally:
        fake.httpd.shutdown()


def test_missing_secret_variable_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ABSENT_SECRET", raising=False)
    with pytest.raises(WeightSyncError, match="ABSENT_SECRET"):
        PolicySync(tmp_path, "http://127.0.0.1:1/v1", secret_env="ABSENT_SECRET")

"""EndpointClient: retries only what may succeed later, backs off, caps concurrency, never raises."""

from __future__ import annotations

import asyncio
import json
import logging
import random

import httpx
import pytest

from prime_composer.client.http import CallError, EndpointClient, read_api_key, redact_url
from prime_composer.config.client import RetryConfig


class Script:
    """A fake endpoint answering from a list of (status | exception, body) in order."""

    def __init__(self, answers: list) -> None:
        self.answers = list(answers)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        status, body, *headers = answer
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.Response(status, content=content, headers=headers[0] if headers else None)


def client_for(script: Script, waits: list[float], **kwargs) -> EndpointClient:
    async def fake_sleep(seconds: float) -> None:
        waits.append(seconds)

    return EndpointClient(
        "http://teacher.test/v1",
        transport=httpx.MockTransport(script),
        sleep=fake_sleep,
        rng=random.Random(0),
        **kwargs,
    )


OK = (200, {"choices": [{"message": {"role": "assistant", "content": "hi"}}]})


def run(coro):
    return asyncio.run(coro)


def test_retries_429_and_5xx_then_succeeds_with_growing_capped_backoff() -> None:
    script = Script([(429, {"error": "slow down"}), (500, b"boom"), (503, b""), OK])
    waits: list[float] = []
    retry = RetryConfig(max_retries=3, backoff_s=1.0, max_backoff_s=3.0)
    result = run(client_for(script, waits, retry=retry).chat_completion({"model": "m", "messages": []}))
    assert result.ok and result.attempts == 4 and result.status == 200
    assert result.data["choices"][0]["message"]["content"] == "hi"
    # Full jitter: wait k is uniform in [0, min(cap, base * 2**(k-1))].
    assert len(waits) == 3
    for k, wait in enumerate(waits, start=1):
        assert 0 <= wait <= min(3.0, 1.0 * 2 ** (k - 1))
    # The body really is what the caller sent, with stream forced off.
    assert json.loads(script.requests[0].content) == {"model": "m", "messages": [], "stream": False}


def test_gives_up_after_max_retries_and_reports_the_last_error() -> None:
    script = Script([(502, b"bad gateway")])
    waits: list[float] = []
    result = run(client_for(script, waits, retry=RetryConfig(max_retries=2)).post_json("/x", {}))
    assert not result.ok
    assert result.attempts == 3 and len(script.requests) == 3 and len(waits) == 2
    assert result.error_kind == "http_502" and "bad gateway" in (result.error or "")
    with pytest.raises(CallError, match="weights update failed after 3 attempt"):
        result.raise_for_error("weights update")


@pytest.mark.parametrize("status", [400, 401, 404, 409, 413, 422])
def test_client_errors_are_not_retried(status: int) -> None:
    script = Script([(status, {"detail": "no"})])
    result = run(client_for(script, []).post_json("/x", {}))
    assert not result.ok and result.attempts == 1 and result.status == status
    assert result.data == {"detail": "no"}  # the error body stays readable


def test_retry_after_is_honoured_up_to_the_cap() -> None:
    script = Script([(429, b"", {"Retry-After": "2.5"}), (429, b"", {"Retry-After": "999"}), OK])
    waits: list[float] = []
    retry = RetryConfig(max_retries=3, backoff_s=0.01, max_backoff_s=10.0)
    assert run(client_for(script, waits, retry=retry).chat_completion({})).ok
    assert waits[0] >= 2.5 and waits[1] == 10.0


def test_timeouts_and_connection_errors_are_data_and_retried() -> None:
    script = Script([httpx.ConnectError("refused"), httpx.ReadTimeout("slow"), OK])
    result = run(client_for(script, [], retry=RetryConfig(max_retries=2)).chat_completion({}))
    assert result.ok and result.attempts == 3
    script = Script([httpx.ReadTimeout("slow")])
    result = run(client_for(script, [], retry=RetryConfig(max_retries=1, timeout_s=7)).chat_completion({}))
    assert not result.ok and result.status is None and result.error_kind == "timeout"
    assert "7" in (result.error or "")


def test_garbage_answers_are_recorded_not_raised() -> None:
    result = run(client_for(Script([(200, b"<html>not json")]), []).chat_completion({}))
    assert not result.ok and result.error_kind == "bad_json" and result.attempts == 1
    result = run(client_for(Script([(200, {"choices": []})]), []).chat_completion({}))
    assert not result.ok and result.error_kind == "bad_response"


def test_concurrency_is_capped() -> None:
    in_flight = 0
    peak = 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return httpx.Response(200, json={"ok": True})

    async def main() -> list:
        client = EndpointClient("http://t/v1", transport=httpx.MockTransport(handler), max_concurrency=3)
        async with client:
            return await asyncio.gather(*(client.post_json("/x", {}) for _ in range(12)))

    results = run(main())
    assert all(r.ok for r in results) and peak == 3


def test_api_key_is_sent_but_never_logged(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    monkeypatch.setenv("MY_TEACHER_KEY", "sk-very-secret")
    key = read_api_key("MY_TEACHER_KEY", "teacher.pool[0].api_key_env")
    script = Script([(500, b"oops"), (401, {"error": "bad key"})])
    caplog.set_level(logging.DEBUG)
    result = run(client_for(script, [], api_key=key).post_json("/x", {}))
    assert script.requests[0].headers["Authorization"] == "Bearer sk-very-secret"
    assert "sk-very-secret" not in caplog.text and "sk-very-secret" not in (result.error or "")


def test_unset_key_variable_names_the_config_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOPE_KEY", raising=False)
    with pytest.raises(ValueError, match=r"orchestrator\.sdpo\.llm\.api_key_env.*'NOPE_KEY'"):
        read_api_key("NOPE_KEY", "orchestrator.sdpo.llm.api_key_env")
    assert read_api_key(None, "x") is None


def test_redact_url_drops_credentials() -> None:
    assert redact_url("https://user:pw@host.example/v1") == "https://host.example/v1"
    assert redact_url("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000/v1"


def test_a_trickling_answer_is_cut_at_the_attempts_time_limit() -> None:
    """A server that sends a byte every 0.1 s never trips httpx's per-read timeout; the attempt's
    wall clock (``timeout_s``) still ends it, as a timeout recorded as data."""
    import socket
    import threading
    import time

    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def trickle() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n")
            for _ in range(100):
                if stop.is_set():
                    return
                try:
                    conn.sendall(b" ")
                except OSError:
                    return
                time.sleep(0.1)

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    client = EndpointClient(
        f"http://127.0.0.1:{server.getsockname()[1]}/v1", retry=RetryConfig(timeout_s=0.5, max_retries=0)
    )
    try:
        result = run(client.get_json("/models"))
    finally:
        stop.set()
        thread.join(timeout=5)
        server.close()
    assert result.error_kind == "timeout" and not result.ok
    assert result.latency_s < 3.0  # the whole answer would take 10 s

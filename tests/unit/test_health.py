"""``health.wait_healthy``: the one poll loop the launcher, ``eval`` and the vLLM backend share."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from prime_composer.health import wait_healthy
from prime_composer.netaddr import client_url


@contextmanager
def server(statuses: list[int]) -> Iterator[tuple[str, list[str]]]:
    """A loopback server answering ``/health`` with ``statuses`` in turn (the last one repeats)."""
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.path)
            status = statuses.pop(0) if len(statuses) > 1 else statuses[0]
            body = b'{"status": "ok"}' if status == 200 else b"starting"
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"{client_url('0.0.0.0', httpd.server_address[1])}/health", seen
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_error_statuses_are_not_yet_healthy() -> None:
    with server([503, 500, 200]) as (url, seen):
        waited = wait_healthy(url, timeout_s=10, poll_s=0.01)
    assert waited.healthy and waited.body == b'{"status": "ok"}'
    assert seen == ["/health"] * 3


def test_give_up_ends_the_wait_with_its_reason() -> None:
    calls = []

    def give_up() -> str | None:
        calls.append(1)
        return "exited with code 1" if len(calls) == 3 else None

    with server([503]) as (url, seen):
        waited = wait_healthy(url, timeout_s=10, poll_s=0.01, give_up=give_up)
    assert not waited.healthy and waited.reason == "exited with code 1" and len(seen) == 2


def test_nothing_listening_times_out_without_a_reason() -> None:
    with server([200]) as (url, _):
        pass  # closed: the port refuses connections now
    waited = wait_healthy(url, timeout_s=0.2, poll_s=0.02, request_timeout_s=0.1)
    assert not waited.healthy and waited.reason is None and waited.elapsed_s >= 0.2


def test_client_url_of_a_bind_address() -> None:
    assert client_url("0.0.0.0", 8000) == "http://127.0.0.1:8000"
    assert client_url("::", 8000) == "http://127.0.0.1:8000"
    assert client_url("::1", 8000) == "http://[::1]:8000"
    assert client_url("10.0.0.2", 80) == "http://10.0.0.2:80"

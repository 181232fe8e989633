"""Serve inside this process, on a free loopback port (``eval``, tests, benchmarks, notebooks):
the ``hf`` server of a config (``running_server``) or any ASGI app (``running_app``).

Usage::

    with running_server(InferenceConfig(...)) as base_url:   # "http://127.0.0.1:<port>"
        httpx.post(f"{base_url}/v1/chat/completions", json=...)
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prime_composer.config.inference import InferenceConfig

KEEP_ALIVE_S = 75
"""Seconds an idle client connection stays open. Longer than httpx's pool expiry (5 s): with
uvicorn's default of 5 s the server closes idle connections just as clients reuse them, and an
unlucky request fails with a connection error (a lost rollout, seen between slow trainer steps)."""


@contextmanager
def running_server(config: InferenceConfig) -> Iterator[str]:
    """The server of ``config.backend`` inside this process on ``127.0.0.1``; yields the base URL
    (``config.host``/``config.port`` are not used for binding: see ``running_app``). A backend
    that runs only as its own process (``vllm``) is a ``ValueError``."""
    from prime_composer.inference.backend import get_backend

    server = get_backend(config.backend).in_process(config)
    if server is None:
        raise ValueError(
            f"inference.backend = {config.backend!r} runs as its own process (uv run inference), "
            "not inside this one"
        )
    with server as url:
        yield url


@contextmanager
def running_app(app: Any, startup_timeout_s: float = 300.0) -> Iterator[str]:
    """Serve an ASGI ``app`` on ``127.0.0.1`` in a background thread until the block exits.

    The socket is bound here (port 0: the OS picks a free one) and handed to uvicorn, so there is
    no race for the port. It is created with ``proto=IPPROTO_TCP``: asyncio only sets
    ``TCP_NODELAY`` on connections accepted from such a socket, and without it every response
    on a kept-alive connection waited ~40 ms for a delayed ACK (headers and body are two writes).
    """
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="on", timeout_keep_alive=KEEP_ALIVE_S)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="hf-uvicorn")
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            thread.join(timeout=60)
            sock.close()
            raise RuntimeError("the in-process inference server did not start (see the log above)")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()

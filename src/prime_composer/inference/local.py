"""Run the hf server inside this process, on a free loopback port (tests, benchmarks, notebooks).

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


@contextmanager
def running_server(config: InferenceConfig, startup_timeout_s: float = 300.0) -> Iterator[str]:
    """Build the app for ``config`` and serve it on ``127.0.0.1``; yields the base URL.

    ``config.host``/``config.port`` are not used for binding (see ``running_app``).
    """
    from prime_composer.inference.server import build_app

    app = build_app(config.model_copy(update={"host": "127.0.0.1"}))
    with running_app(app, startup_timeout_s) as url:
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

    from prime_composer.inference.server import KEEP_ALIVE_S

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

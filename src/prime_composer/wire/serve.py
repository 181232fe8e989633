"""One HTTP(S) server in a thread, for the endpoints other machines reach (the DiLoCo origin and
relay, the weights origin of remote inference workers).

``ServerThread(host, port, handler, tls=..., name=...)`` binds ``host`` (IPv4 or IPv6, brackets
allowed; port 0 takes a free one), wraps the socket in ``tls`` when given (the handshake happens
in the request's thread, so a slow client holds only its own), serves until ``close()``. A request
that fails (a failed handshake, a client that hangs up) is logged at debug level under ``name``:
it is the client's problem, not a traceback in the server's log.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from http.server import ThreadingHTTPServer
from typing import Any

logger = logging.getLogger(__name__)


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    label = "server"

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("%s: request from %s failed", self.label, client_address, exc_info=True)


class ServerThread:
    """``handler`` served on ``host:port`` in a daemon thread named ``name``."""

    def __init__(
        self,
        host: str,
        port: int,
        handler: Any,
        *,
        tls: ssl.SSLContext | None = None,
        name: str,
    ) -> None:
        """``handler``: a ``BaseHTTPRequestHandler`` class (or a callable making one)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_class = type("Server", (_QuietServer,), {"address_family": family, "label": name})
        self.server: ThreadingHTTPServer = server_class((host.strip("[]"), port), handler)
        if tls is not None:
            self.server.socket = tls.wrap_socket(
                self.server.socket, server_side=True, do_handshake_on_connect=False
            )
        self.scheme = "https" if tls is not None else "http"
        self._thread = threading.Thread(target=self.server.serve_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)

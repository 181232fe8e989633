"""Making torchft 0.2.0 listen on ``diloco.host`` only, and checking that it does.

torchft binds its servers to every interface whatever host it is given (the ManagerServer on
``[::]``, the checkpoint HTTP server on ``("", 0)``, the TCPStore's libuv server on the
wildcard), and none of them authenticates; the checkpoint server even unpickles what it
fetches (``weights_only=False``). Without patching its files:

- the TCPStore listens on a socket bound here to ``(host, store_port)`` (``master_listen_fd``);
- the ManagerServer is built with ``bind = host:port`` (torchft's ``Manager`` hard-codes
  ``[::]``: its module's ``ManagerServer`` name is swapped for a wrapper while the Manager is
  constructed, under a lock);
- the checkpoint transport is an ``HTTPTransport`` whose server binds ``host`` and which
  advertises ``host`` (torchft advertises ``socket.gethostname()``);
- gloo's device is created for ``host``, so its pair sockets listen there.

``listening_sockets()`` lists this process's listening TCP sockets (``/proc``), and
``check_bound(host, before)`` raises ``RuntimeError`` if one opened since ``before`` listens on
another address: the outer loop refuses to run then. All of this only narrows *where* torchft
listens; it still authenticates nothing, which is why a non-loopback torchft setup needs
``diloco.private_network = true`` (config rule).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

_PATCH_LOCK = threading.RLock()  # bound_transport runs inside manager_bound_to


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listening_sockets() -> set[tuple[str, int, int]]:
    """``(address, port, inode)`` of every TCP socket this process listens on."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    out = set()
    for table, size in (("/proc/self/net/tcp", 4), ("/proc/self/net/tcp6", 16)):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] != "0A" or int(fields[9]) not in inodes:  # 0A: LISTEN
                    continue
                hex_addr, hex_port = fields[1].split(":")
                raw = bytes.fromhex(hex_addr)
                # /proc prints each 32-bit word in host (little-endian) order.
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                addr = ipaddress.ip_address(raw if size == 16 else raw[:4])
                if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
                    addr = addr.ipv4_mapped
                out.add((str(addr), int(hex_port, 16), int(fields[9])))
    return out


def check_bound(host: str, before: set[tuple[str, int, int]], what: str = "torchft") -> None:
    """``RuntimeError`` if a socket opened since ``before`` listens on an address other than
    ``host`` (a wildcard included)."""
    want = {socket.getaddrinfo(host, None, _family(host))[0][4][0]}
    wrong = sorted((a, p) for a, p, _ in listening_sockets() - before if a not in want)
    if wrong:
        listed = ", ".join(f"{a}:{p}" for a, p in wrong)
        raise RuntimeError(
            f"{what} listens on {listed}, not only on diloco.host = {host!r}: refusing to run an "
            "unauthenticated server there (this torchft version cannot be told to bind that address)"
        )


def store_socket(host: str, port: int) -> socket.socket:
    """A listening socket on ``(host, port)`` for ``TCPStore(master_listen_fd=...)``."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


@contextlib.contextmanager
def manager_bound_to(host: str) -> Iterator[None]:
    """While a ``torchft.Manager`` is constructed, its ManagerServer binds ``host``."""
    import torchft.manager as manager_module

    real = manager_module.ManagerServer

    def bound(*args: Any, bind: str, **kwargs: Any) -> Any:
        port = int(bind.rsplit(":", 1)[1])
        return real(*args, bind=_hostport(host, port), **kwargs)

    with _PATCH_LOCK:
        manager_module.ManagerServer = bound  # type: ignore[assignment,misc]
        try:
            yield
        finally:
            manager_module.ManagerServer = real  # type: ignore[misc]


def bound_transport(host: str, timeout: timedelta) -> Any:
    """torchft's ``HTTPTransport`` with its server on ``(host, 0)``, advertising ``host``."""
    import torchft.checkpointing.http_transport as http_module
    from torchft.checkpointing import HTTPTransport

    server_class = type(
        "_BoundServer", (ThreadingHTTPServer,), {"address_family": _family(host), "daemon_threads": True}
    )

    class _Bound(HTTPTransport):  # type: ignore[misc]
        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            return f"http://{_hostport(host, port)}/checkpoint/"

    real = http_module._IPv6HTTPServer
    with _PATCH_LOCK:
        http_module._IPv6HTTPServer = lambda _address, handler: server_class((host, 0), handler)  # type: ignore[assignment,misc]
        try:
            return _Bound(timeout=timeout, num_chunks=0)
        finally:
            http_module._IPv6HTTPServer = real  # type: ignore[misc]


def gloo_bound_to(host: str, timeout: timedelta) -> Any:
    """torchft's reconfigurable gloo process group with its device on ``host``."""
    import torch
    from torch.distributed import ProcessGroup, ProcessGroupGloo
    from torchft import ProcessGroupGloo as TorchftGloo

    class _BoundGloo(TorchftGloo):  # type: ignore[misc]
        def _create_pg(self, store: Any, rank: int, world_size: int) -> ProcessGroup:
            options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            options._timeout = self._timeout
            options._devices = [ProcessGroupGloo.create_device(hostname=host)]
            backend = ProcessGroupGloo(store, rank, world_size, options)
            backend._set_sequence_number_for_group()
            pg = ProcessGroup(store, rank, world_size)
            pg._set_default_backend(ProcessGroup.BackendType.GLOO)
            pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
            return pg

    return _BoundGloo(timeout=timeout)

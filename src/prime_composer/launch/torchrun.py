"""torchrun whose servers listen on one address only: ``python -m prime_composer.launch.torchrun
--bind-host HOST|route:PEER <torchrun arguments>``.

torch's elastic agent starts two TCPStore servers (the c10d rendezvous store on the node that
hosts ``--rdzv-endpoint``, and the store the ranks bootstrap their process group from on the
agent of group rank 0), and a TCPStore server listens on every interface whatever host it is
given. Neither authenticates. This wrapper hands each of them a socket bound to ``HOST`` only
(``TCPStore(master_listen_fd=...)``), so the default ``launch.rdzv_endpoint = 127.0.0.1:...``
keeps the trainer's rendezvous private to the machine and a cluster endpoint listens on the
cluster address alone (``route:PEER``, on a node other than 0: the address this machine reaches
node 0 from; it is also the ``--local-addr`` the agent advertises). The ranks' gloo and NCCL
sockets go on the interface that holds ``HOST`` (``lo`` for loopback), unless
``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` already say otherwise. Then it runs
``torch.distributed.run`` unchanged.

If this torch version creates its stores elsewhere, the wrapper refuses to start (it never falls
back to listening on every interface).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

from prime_composer.netaddr import is_loopback


def bound_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``(host, port)`` (``port`` 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(1024)
    return sock


def bind_stores_to(host: str) -> None:
    """Make every TCPStore server torch's elastic agent creates listen on ``host`` only."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous

    real: Any = dist.TCPStore
    handler = getattr(dynamic_rendezvous, "DynamicRendezvousHandler", None)
    known = getattr(c10d_rendezvous_backend, "TCPStore", None) is dist.TCPStore
    if not known or not hasattr(handler, "_create_tcp_store_server"):
        raise SystemExit(
            "prime_composer.launch.torchrun: this torch version creates its rendezvous stores in a "
            f"way this wrapper does not know (torch {getattr(__import__('torch'), '__version__', '?')}); "
            "refusing to start servers that would listen on every interface"
        )

    def store(
        host_name: str, port: int, world_size: int | None = None, is_master: bool = False, **kwargs: Any
    ) -> Any:
        if not is_master:
            return real(host_name, port, world_size, False, **kwargs)
        sock = bound_listener(host, port)
        bound_port = sock.getsockname()[1]
        kwargs["master_listen_fd"] = sock.detach()
        return real(host_name, bound_port, world_size, True, **kwargs)

    def server(self: Any, master_addr: str, master_port: int) -> Any:
        return store(master_addr, master_port, is_master=True, multi_tenant=True)

    c10d_rendezvous_backend.TCPStore = store  # type: ignore[misc,assignment]
    handler._create_tcp_store_server = server  # type: ignore[union-attr]


def route_address(peer: str) -> str:
    """This machine's address on the way to ``peer`` (what the kernel would send from; a UDP
    ``connect`` sends nothing)."""
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect((peer.strip("[]"), 9))
        return str(sock.getsockname()[0])


def interface_of(address: str) -> str | None:
    """The network interface whose IPv4 address is ``address`` (Linux ``SIOCGIFADDR``), if any."""
    import fcntl
    import struct

    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            try:
                packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == address:
            return name
    return None


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] != "--bind-host":
        raise SystemExit(
            "usage: python -m prime_composer.launch.torchrun --bind-host HOST|route:PEER <torchrun args>"
        )
    host, rest = args[1], args[2:]
    if host.startswith("route:"):  # a node other than 0: the address it reaches node 0 from
        host = route_address(host.removeprefix("route:"))
    if not any(a.startswith(("--local-addr", "--local_addr")) for a in rest):
        # The agent of global rank 0 hosts the ranks' store and advertises this address for it.
        rest = [f"--local-addr={host}", *rest]
    interface = "lo" if is_loopback(host) else interface_of(host)
    if interface is not None:  # the ranks' gloo/NCCL sockets on the same interface (unless set)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    bind_stores_to(host)
    from torch.distributed.run import main as torchrun_main

    torchrun_main(rest)


if __name__ == "__main__":
    main()

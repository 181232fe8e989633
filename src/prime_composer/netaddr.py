"""Whether an address to bind keeps a server private to this machine (stdlib only: the vLLM
backend's middleware imports this inside vLLM's own environment, and config/ validates with it)."""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server reachable from this machine only (a host name
    other than the loopback ones may resolve to anything, so it counts as reachable)."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def server_root(base_url: str) -> str:
    """``http://host:port`` from an OpenAI base URL (``http://host:port/v1``)."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def client_url(bind_host: str, port: int) -> str:
    """``http://host:port`` for a client on this machine reaching a server bound to ``bind_host``
    (an all-interfaces bind is reached on 127.0.0.1; an IPv6 address is bracketed)."""
    host = "127.0.0.1" if bind_host in ("0.0.0.0", "::", "") else bind_host.strip("[]")
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"

"""Whether an address to bind keeps a server private to this machine (stdlib only: the vLLM
backend's middleware imports this inside vLLM's own environment, and config/ validates with it)."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

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


def peer_url_problem(value: str, *, private_network: bool, flag: str, pin_word: str = "the") -> str | None:
    """What is wrong with a peer given as ``https://host:port@sha256:<fingerprint>`` (or plain
    ``http://`` on loopback, or off it where ``flag``, the key saying the link is private, is
    set), or None when it will do. The caller prefixes its key and value."""
    url, _, pin = value.partition("@")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "expected https://host:port@sha256:<fp>"
    if parts.scheme == "https" and not pin:
        return f"pin {pin_word} certificate (@sha256:<fp>)"
    if parts.scheme == "http" and not is_loopback(parts.hostname) and not private_network:
        return (
            "plain HTTP off loopback; use https://host:port@sha256:<fp> (the server's --tls-cert; "
            f"`rl certs` makes one), or {flag} = true if the link is already private"
        )
    return None

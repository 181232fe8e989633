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

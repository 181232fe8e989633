"""The shared secret that guards the admin endpoints (``/update_weights``, ``/reload_weights``).

Rules: a server bound to loopback may run without a secret (only this machine can reach it); a
server bound to anything else must have ``inference.secret_env`` naming a set environment
variable, or it refuses to start. When a secret is configured, admin requests must send
``Authorization: Bearer <secret>`` whatever the bind address. The secret is compared in constant
time and never logged or echoed in an error.
"""

from __future__ import annotations

import hmac
import ipaddress
import os

from fastapi import HTTPException, Request

_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server reachable from this machine only."""
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost: may resolve to anything
        return False


def resolve_admin_secret(host: str, secret_env: str | None) -> str | None:
    """The secret admin requests must carry, or ``None`` when none is configured (loopback only).

    Raises ``ValueError`` naming ``inference.secret_env`` when the server would be reachable from
    other machines without one.
    """
    secret = os.environ.get(secret_env) if secret_env else None
    if secret_env and not secret:
        raise ValueError(
            f"inference.secret_env = {secret_env!r}, but that environment variable is unset or empty; "
            f"export {secret_env}=<a long random string> (the same value the trainer/orchestrator use)"
        )
    if not is_loopback(host) and not secret:
        raise ValueError(
            f"inference.host = {host!r} is reachable beyond this machine, so the admin endpoints need a "
            "shared secret: set inference.secret_env to the name of an environment variable holding it "
            "(e.g. --inference.secret_env INFERENCE_SECRET), or bind inference.host = '127.0.0.1'"
        )
    return secret or None


def check_bearer(request: Request, secret: str | None) -> None:
    """Raise 401 unless the request carries the admin secret (no-op when none is configured)."""
    if secret is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise HTTPException(
            status_code=401,
            detail="admin endpoint: missing shared secret; send 'Authorization: Bearer <secret>' "
            "with the value of the variable named by inference.secret_env",
        )
    if not hmac.compare_digest(token.strip().encode(), secret.encode()):
        raise HTTPException(status_code=401, detail="admin endpoint: wrong shared secret")

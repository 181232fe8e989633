"""The shared secret that guards the inference server (every route except ``/health``).

Rules: a server bound to loopback may run without a secret (only this machine can reach it); a
server bound to anything else must have ``inference.secret_env`` naming a set environment
variable, or it refuses to start. When a secret is configured, every request except
``GET /health`` must prove it knows the secret whatever the bind address (generation and
``/v1/models`` too: an exposed server must not be free compute): by a signed request
(``wire.auth``, the secret never sent), or by ``Authorization: Bearer <secret>`` from this
machine (or any machine with ``inference.private_network``). The check itself runs in
``guard.RequestGuard``. The secret is compared in constant time and never logged or echoed in an
error.

Stdlib only: the vLLM backend's middleware imports this inside vLLM's process.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from prime_composer.netaddr import is_loopback


def resolve_admin_secret(host: str, secret_env: str | None) -> str | None:
    """``serving_secret`` of the inference server (``inference.host``, ``inference.secret_env``)."""
    return serving_secret(host, secret_env, "inference")


def serving_secret(host: str, secret_env: str | None, section: str) -> str | None:
    """The secret a server's requests must carry, or ``None`` when none is configured (loopback only).

    Raises ``ValueError`` naming ``<section>.secret_env`` when the variable is unset, or when the
    server would be reachable from other machines without a secret.
    """
    secret = os.environ.get(secret_env) if secret_env else None
    if secret_env and not secret:
        raise ValueError(
            f"{section}.secret_env = {secret_env!r}, but that environment variable is unset or empty; "
            f"export {secret_env}=<a long random string> (the same value its clients use)"
        )
    if not is_loopback(host) and not secret:
        raise ValueError(
            f"{section}.host = {host!r} is reachable beyond this machine, so the server needs a "
            f"shared secret: set {section}.secret_env to the name of an environment variable holding it, "
            f"or bind {section}.host = '127.0.0.1'"
        )
    return secret or None


def bearer_error(authorization: str | None, secret: str) -> str | None:
    """Why a request whose ``Authorization`` header is ``authorization`` may not pass, or ``None``.

    Both sides are hashed before the constant-time comparison, so neither the secret's bytes nor
    its length can be learned from response times.
    """
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return (
            "missing shared secret; send 'Authorization: Bearer <secret>' with the value of the "
            "variable named by inference.secret_env"
        )
    given = hashlib.sha256(token.encode("utf-8", errors="surrogateescape")).digest()
    expected = hashlib.sha256(secret.encode("utf-8", errors="surrogateescape")).digest()
    if not hmac.compare_digest(given, expected):
        return "wrong shared secret"
    return None

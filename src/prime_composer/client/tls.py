"""How an HTTPS client trusts an inference server: a pinned certificate fingerprint, or a CA.

``InferenceTLS(fingerprint=...)``: the server's certificate must have exactly that SHA-256
fingerprint (``sha256:<64 hex>``, what ``python -m prime_composer.wire.tls`` prints for the
self-signed certificate it makes), whatever its names or issuer. The pin is checked right after
the TLS handshake, before a byte of the request is written (``_PinnedBackend``): a server with
another certificate never sees the request, its signature header or its prompt.

``InferenceTLS(ca=path)``: the server's chain must verify against the CA certificates in ``path``
(PEM), and its certificate must name the host the client addressed (the usual web rules).

``async_transport(tls, limits)`` is the ``httpx`` transport every client of an inference server
uses (``client.http.EndpointClient``, the replica relay of ``orchestrator/replicas.py``).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpcore
import httpx

from prime_composer.wire.tls import client_context, pin_mismatch


@dataclass(frozen=True)
class InferenceTLS:
    """What a client checks of an ``https://`` inference server (exactly one of the two)."""

    fingerprint: str | None = None
    ca: Path | None = None

    def __post_init__(self) -> None:
        if (self.fingerprint is None) == (self.ca is None):
            raise ValueError("InferenceTLS: give a certificate fingerprint or a CA file, exactly one")


def inference_tls(fingerprint: str | None, ca: Path | None) -> InferenceTLS | None:
    """``orchestrator.inference_tls_fingerprint`` / ``inference_tls_ca`` as an ``InferenceTLS``
    (None when neither is set)."""
    if fingerprint is None and ca is None:
        return None
    return InferenceTLS(fingerprint=fingerprint, ca=ca)


class _PinnedStream(httpcore.AsyncNetworkStream):
    """A TCP stream whose ``start_tls`` refuses a certificate other than the pinned one."""

    def __init__(self, inner: httpcore.AsyncNetworkStream, fingerprint: str) -> None:
        self._inner = inner
        self._fingerprint = fingerprint

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._inner.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)

    async def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._inner.start_tls(ssl_context, server_hostname, timeout)
        ssl_object = stream.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
        got = pin_mismatch(der, self._fingerprint)
        if got is not None:
            await stream.aclose()
            raise httpcore.ConnectError(
                f"https://{server_hostname} presented certificate {got}, but {self._fingerprint} is pinned "
                "for it (orchestrator.inference_tls_fingerprint): refusing to send it anything (a wrong pin, "
                "a regenerated certificate, or someone in the middle)"
            )
        return _PinnedStream(stream, self._fingerprint)


class _PinnedBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, fingerprint: str) -> None:
        from httpcore._backends.auto import AutoBackend

        self._inner = AutoBackend()
        self._fingerprint = fingerprint

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        return _PinnedStream(stream, self._fingerprint)

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Any = None
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("unix sockets are not used for inference servers")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


def ca_context(ca: Path) -> ssl.SSLContext:
    """A client context that trusts the CA certificates in ``ca`` only (hostnames checked)."""
    try:
        return ssl.create_default_context(cafile=str(ca))
    except (OSError, ssl.SSLError) as e:
        raise ValueError(
            f"the CA file {str(ca)!r} does not load ({e}); give a PEM file of CA certificates"
        ) from None


def async_transport(tls: InferenceTLS | None, limits: httpx.Limits) -> httpx.AsyncHTTPTransport:
    """The transport of a client of inference servers checking ``tls`` (None: the system's CAs)."""
    if tls is None:
        return httpx.AsyncHTTPTransport(limits=limits)
    if tls.ca is not None:
        return httpx.AsyncHTTPTransport(verify=ca_context(tls.ca), limits=limits)
    assert tls.fingerprint is not None
    transport = httpx.AsyncHTTPTransport(verify=client_context(), limits=limits)
    # httpx has no hook between the handshake and the request: the pool it made is replaced by one
    # with the same settings whose connections check the pin at ``start_tls``.
    transport._pool = httpcore.AsyncConnectionPool(
        ssl_context=client_context(),
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        network_backend=_PinnedBackend(tls.fingerprint),
    )
    return transport

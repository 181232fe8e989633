"""What every request passes before a route sees it, on both backends: the shared secret and the
body-size limit; and the error type and body every refusal uses (``APIError``, ``error_response``).

``RequestGuard`` is a pure ASGI middleware (starlette only, no FastAPI), so the ``hf`` server and
the ``vllm`` backend's admin middleware, which runs inside vLLM's process and environment, share it:

- with a secret configured, every path except ``/health`` (generation, ``/v1/models``, the admin
  routes, docs and unknown paths alike) needs one of two proofs, 401 otherwise (a websocket is
  closed, 1008):

  - a **signed request** (``X-Prime-Composer-Auth``, ``wire.auth``: HMAC over method, path, body
    digest, audience, timestamp and nonce with a key derived from the secret), what the
    orchestrator sends. The secret never crosses the wire, and a captured request is refused when
    replayed (nonce already seen, or timestamp outside the window) or sent to a server whose
    ``inference.audience`` is another. The body is read whole (within the size limit) before
    the check, then handed to the route;
  - ``Authorization: Bearer <secret>`` (``auth.bearer_error``: constant time, the secret never
    echoed), what OpenAI clients send: accepted from a loopback peer only, unless
    ``inference.private_network`` says the links to this server are private (a bearer token is
    reusable by anyone who sees it);
- a body larger than ``max_body_bytes`` is answered 413: at once when ``Content-Length`` says so,
  otherwise (chunked upload) as soon as the bytes read pass the limit: the 413 is sent from
  ``receive`` and ``BodyTooLarge`` raised there to stop the route (an ``HTTPException``, which
  FastAPI lets through its body parsing); whatever the app answers after that is dropped.

Errors have OpenAI's body ``{"error": {"message", "type", "param", "code"}}`` (``error_response``).
"""

from __future__ import annotations

from typing import Any

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prime_composer.inference.auth import bearer_error
from prime_composer.netaddr import is_loopback
from prime_composer.wire.auth import INFERENCE_HEADER, Verifier, inference_key

OPEN_PATHS = frozenset({"/health"})
"""Paths that need no secret: the launcher and load balancers poll them."""

REPLAY_WINDOW_S = 120.0
"""How far a signed request's timestamp may be from the server's clock (its nonce is remembered
for twice that)."""

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
"""The default of ``inference.max_request_bytes`` (for apps built without a config)."""

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    422: "BadRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """A refusal, answered as ``{"error": {...}}`` with ``status`` (routes raise it)."""

    def __init__(
        self, status: int, message: str, error_type: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type or ERROR_TYPES.get(status, "Error")
        self.param = param
        """The request field at fault (OpenAI's ``error.param``), when there is one."""

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return error_response(self.status, self.message, self.error_type, headers, self.param)


def error_body(
    status: int, message: str, error_type: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object for ``status``."""
    return {
        "error": {
            "message": message,
            "type": error_type or ERROR_TYPES.get(status, "Error"),
            "param": param,
            "code": status,
        }
    }


def error_response(
    status: int,
    message: str,
    error_type: str | None = None,
    headers: dict[str, str] | None = None,
    param: str | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, error_type, param), status_code=status, headers=headers)


def too_large_message(limit: int) -> str:
    return (
        f"the request body is larger than inference.max_request_bytes = {limit} bytes; "
        "send a shorter prompt (or raise the limit on the server)"
    )


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` once a body passes the limit (FastAPI lets HTTPExceptions through)."""

    def __init__(self, limit: int) -> None:
        super().__init__(status_code=413, detail=too_large_message(limit))


class RequestGuard:
    """ASGI middleware: a signed request or the secret (see the module docstring) on every path but
    ``open_paths``, and the body-size limit."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        secret: str | None,
        max_body_bytes: int,
        open_paths: frozenset[str] = OPEN_PATHS,
        private_network: bool = False,
        audience: str | None = None,
        window_s: float = REPLAY_WINDOW_S,
    ) -> None:
        self.app = app
        self.secret = secret
        self.max_body_bytes = max_body_bytes
        self.open_paths = open_paths
        self.private_network = private_network
        self.verifier = Verifier(inference_key(secret), audience, window_s) if secret else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        if self.secret is not None and scope.get("path") not in self.open_paths:
            signature = _header(scope, INFERENCE_HEADER.lower().encode())
            if signature is not None:
                await self._signed(scope, receive, send, signature)
                return
            refusal = self._bearer_refusal(scope)
            if refusal is not None:
                await _refuse(scope, receive, send, refusal)
                return
        if scope["type"] == "websocket":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await error_response(413, too_large_message(self.max_body_bytes))(scope, receive, send)
            return

        num_received = 0
        response_started = answered_here = False

        async def limited_receive() -> Message:
            nonlocal num_received, answered_here
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > self.max_body_bytes:
                    if not response_started:
                        # Answered here, in our format, whatever the app's handlers would say.
                        await error_response(413, too_large_message(self.max_body_bytes))(
                            scope, receive, send
                        )
                        answered_here = True
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            if answered_here:  # the app's own answer to BodyTooLarge: already answered
                return
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not answered_here:
                raise

    def _bearer_refusal(self, scope: Scope) -> str | None:
        assert self.secret is not None
        client = scope.get("client")
        if not self.private_network and not (client and is_loopback(str(client[0]))):
            return (
                "'Authorization: Bearer' is accepted only from this machine (a token seen on the "
                f"network is reusable): sign the request ({INFERENCE_HEADER}, "
                "prime_composer.wire.auth.Signer), or set inference.private_network = true if every "
                "link to this server is private"
            )
        return bearer_error(_header(scope, b"authorization"), self.secret)

    async def _signed(self, scope: Scope, receive: Receive, send: Send, signature: str) -> None:
        """Check a signed request (its whole body first), then pass it on with that body."""
        assert self.verifier is not None
        body = b""
        if scope["type"] == "http":
            declared = _header(scope, b"content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
                await error_response(413, too_large_message(self.max_body_bytes))(scope, receive, send)
                return
            chunks, total = [], 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                total += len(chunk)
                if total > self.max_body_bytes:
                    await error_response(413, too_large_message(self.max_body_bytes))(scope, receive, send)
                    return
                chunks.append(chunk)
                if not message.get("more_body"):
                    break
            body = b"".join(chunks)
        refusal = self.verifier.check(scope.get("method", "GET"), _signed_path(scope), body, signature)
        if refusal is not None:
            await _refuse(scope, receive, send, refusal)
            return
        if scope["type"] == "websocket":
            await self.app(scope, receive, send)
            return
        delivered = False

        async def replay_body() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay_body, send)


async def _refuse(scope: Scope, receive: Receive, send: Send, reason: str) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008, "reason": reason[:120]})
    else:
        await error_response(401, reason)(scope, receive, send)


def _signed_path(scope: Scope) -> str:
    """The request target as the client signed it: the raw path, with the query when there is one."""
    raw = scope.get("raw_path")
    path = bytes(raw).decode("latin-1") if raw else str(scope.get("path", "/"))
    query = scope.get("query_string") or b""
    return f"{path}?{bytes(query).decode('latin-1')}" if query else path


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None

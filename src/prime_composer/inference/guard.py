"""What every request passes before a route sees it, on both backends: the shared secret and the
body-size limit; and the error type and body every refusal uses (``APIError``, ``error_response``).

``RequestGuard`` is a pure ASGI middleware (starlette only, no FastAPI), so the ``hf`` server and
the ``vllm`` backend's admin middleware, which runs inside vLLM's process and environment, share it:

- with a secret configured, every path except ``/health`` needs ``Authorization: Bearer <secret>``
  (generation, ``/v1/models``, the admin routes, docs and unknown paths alike); 401 otherwise
  (``auth.bearer_error``: constant time, the secret never echoed). A websocket is closed (1008);
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

OPEN_PATHS = frozenset({"/health"})
"""Paths that need no secret: the launcher and load balancers poll them."""

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
    """ASGI middleware: the secret on every path but ``open_paths``, and the body-size limit."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        secret: str | None,
        max_body_bytes: int,
        open_paths: frozenset[str] = OPEN_PATHS,
    ) -> None:
        self.app = app
        self.secret = secret
        self.max_body_bytes = max_body_bytes
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        if self.secret is not None and scope.get("path") not in self.open_paths:
            refusal = bearer_error(_header(scope, b"authorization"), self.secret)
            if refusal is not None:
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008, "reason": refusal})
                else:
                    await error_response(401, refusal)(scope, receive, send)
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


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None

"""The admin routes of the ``vllm`` backend, served inside vLLM's own API server process.

vLLM is started with ``--middleware prime_composer.inference.vllm.admin.AdminRoutesMiddleware``
(a documented vLLM server option: a class given there is added with ``app.add_middleware``). This
pure ASGI middleware answers three paths itself and passes every other request, streaming
included, to vLLM untouched:

- ``POST /update_weights {"path": ...}``: pause scheduling until the running requests finish
  (``pause_generation(mode="wait")``: every completion comes from one set of weights, as with the
  ``hf`` backend), run ``WeightUpdateExtension.prime_composer_load_weights`` on every worker via
  ``engine_client.collective_rpc``, drop the prefix cache (its KV blocks were computed with the
  old weights), resume;
- ``POST /reload_weights``: the same with the base weights;
- ``GET /health``: vLLM's engine health check, answered with the ``hf`` backend's body
  ``{"status", "model", "weights": {"path", "step"}}``.

The contract is the ``hf`` server's: same bodies, same error format
``{"error": {"message", "type", "param", "code"}}`` and codes (400 malformed body, 401 missing or
wrong secret, 403 a path outside ``<output_dir>/broadcasts``, 404 missing, 409 no ``STABLE``).

Why a middleware rather than the alternatives: a front process proxying ``/v1/*`` to vLLM adds a
hop and must re-implement streaming and errors; vLLM's dev-mode ``/collective_rpc`` route would
expose arbitrary worker calls without our secret; building vLLM's app from its Python internals
would copy code that changes every release; vLLM's endpoint plugins need an installed entry point
and an allowlist (``VLLM_PLUGINS``) that also filters every other vLLM plugin. The middleware
runs before vLLM's routing, so these paths win over vLLM's own routes of the same name (vLLM
0.32 has its own ``/update_weights`` for NCCL weight transfer, with another body).

Settings come from the launcher through the environment variable ``PRIME_COMPOSER_VLLM_ADMIN``
(JSON: ``broadcast_root``, ``secret_env``, ``served_model_name``); the secret itself is read from
the variable named by ``secret_env``, never passed on a command line. The launcher imports this
module too (for those settings), so torch is only imported where a route needs it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

logger = logging.getLogger(__name__)

SETTINGS_ENV = "PRIME_COMPOSER_VLLM_ADMIN"
LOAD_METHOD = "prime_composer_load_weights"
RELOAD_METHOD = "prime_composer_reload_base_weights"

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class AdminError(Exception):
    """An error answered with the OpenAI error body and ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class UpdateWeightsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str
    """A ``step_<N>`` directory published under ``<output_dir>/broadcasts`` (absolute, or
    relative to that root)."""


def admin_settings(broadcast_root: Path, secret_env: str | None, served_model_name: str) -> str:
    """The value of ``PRIME_COMPOSER_VLLM_ADMIN`` the launcher sets for vLLM's process."""
    return json.dumps(
        {
            "broadcast_root": str(Path(broadcast_root).resolve()),
            "secret_env": secret_env,
            "served_model_name": served_model_name,
        }
    )


def checked_weight_path(raw: str, root: Path) -> Path:
    """Resolve ``raw`` (relative paths are under ``root``; symlinks followed) and refuse anything
    that is not a published step directory inside ``root``."""
    from prime_composer.transport.weights import STABLE_MARKER  # imports torch: not at module level

    root = Path(root).resolve()
    candidate = Path(raw).expanduser()
    path = (candidate if candidate.is_absolute() else root / candidate).resolve()
    if path == root or not path.is_relative_to(root):
        raise AdminError(
            403,
            f"weight path {raw!r} is outside the broadcast root {root}: only step directories "
            "published there by the trainer are accepted",
        )
    if not path.is_dir():
        raise AdminError(404, f"weight directory {path} does not exist")
    if not (path / STABLE_MARKER).is_file():
        raise AdminError(409, f"weight directory {path} has no {STABLE_MARKER} marker (still being written?)")
    return path


class AdminRoutesMiddleware:
    """ASGI middleware adding the weight-update routes and ``/health`` to vLLM's server."""

    def __init__(self, app: ASGIApp, settings: dict[str, Any] | None = None) -> None:
        self.app = app
        if settings is None:
            raw = os.environ.get(SETTINGS_ENV)
            if not raw:
                raise ValueError(
                    f"{SETTINGS_ENV} is not set: start vLLM through prime_composer's serve_vllm "
                    "(inference.backend = 'vllm'), which sets it, instead of passing --middleware by hand"
                )
            settings = json.loads(raw)
        self.broadcast_root = Path(settings["broadcast_root"])
        self.served_model_name = str(settings["served_model_name"])
        secret_env = settings.get("secret_env")
        self.secret = os.environ.get(secret_env) if secret_env else None
        if secret_env and not self.secret:
            raise ValueError(f"inference.secret_env = {secret_env!r}, but that variable is unset or empty")
        self.current: dict[str, Any] = {"path": None, "step": None}
        self._lock: asyncio.Lock | None = None  # made lazily, inside the server's event loop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = (scope.get("method"), scope.get("path")) if scope["type"] == "http" else None
        handler = {
            ("POST", "/update_weights"): self._update_weights,
            ("POST", "/reload_weights"): self._reload_weights,
            ("GET", "/health"): self._health,
        }.get(route)  # type: ignore[arg-type]
        if handler is None:
            if route is not None and route[1] in ("/update_weights", "/reload_weights"):
                await _error(405, f"{route[1]} takes POST")(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            response = await handler(request)
        except AdminError as e:
            response = _error(e.status, e.message)
        await response(scope, receive, send)

    async def _health(self, request: Request) -> JSONResponse:
        try:
            await _engine(request).check_health()
        except Exception as e:  # the engine died: the same 503 vLLM's own /health answers
            raise AdminError(503, f"the vLLM engine is not healthy: {e}") from e
        return JSONResponse({"status": "ok", "model": self.served_model_name, "weights": dict(self.current)})

    async def _update_weights(self, request: Request) -> JSONResponse:
        self._check_secret(request)
        try:
            raw = await request.json()
        except ValueError as e:
            raise AdminError(400, f"the request body is not valid JSON: {e}") from e
        try:
            body = UpdateWeightsBody.model_validate(raw)
        except ValidationError as e:
            raise AdminError(400, _describe_validation(e)) from e
        from prime_composer.transport.weights import parse_step

        path = checked_weight_path(body.path, self.broadcast_root)
        await self._swap(request, LOAD_METHOD, (str(path),))
        self.current.update(path=str(path), step=parse_step(path))
        logger.info("serving weights from %s", path)
        return JSONResponse({"status": "ok", **self.current})

    async def _reload_weights(self, request: Request) -> JSONResponse:
        self._check_secret(request)
        await self._swap(request, RELOAD_METHOD, ())
        self.current.update(path=None, step=None)
        logger.info("serving the base weights again")
        return JSONResponse({"status": "ok", **self.current})

    async def _swap(self, request: Request, method: str, args: tuple[Any, ...]) -> None:
        """Run ``method`` on every worker between requests, then forget cached KV blocks."""
        engine = _engine(request)
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            await engine.pause_generation(mode="wait")
            try:
                await engine.collective_rpc(method, args=args)
                # Cached prefixes hold keys/values computed by the old weights.
                await engine.reset_prefix_cache()
            except Exception as e:
                logger.exception("%s failed", method)
                raise AdminError(500, f"{method} failed in the vLLM workers: {e}") from e
            finally:
                await engine.resume_generation()

    def _check_secret(self, request: Request) -> None:
        if self.secret is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise AdminError(
                401,
                "admin endpoint: missing shared secret; send 'Authorization: Bearer <secret>' "
                "with the value of the variable named by inference.secret_env",
            )
        if not hmac.compare_digest(token.strip().encode(), self.secret.encode()):
            raise AdminError(401, "admin endpoint: wrong shared secret")


def _engine(request: Request) -> Any:
    """vLLM's engine client, which its own routes also read from the app state."""
    return request.app.state.engine_client


def _error(status: int, message: str) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "Error"),
            "param": None,
            "code": status,
        }
    }
    return JSONResponse(body, status_code=status)


def _describe_validation(error: ValidationError) -> str:
    parts = []
    for item in error.errors()[:5]:
        location = ".".join(str(x) for x in item.get("loc", ()))
        parts.append(f"{location or 'body'}: {item.get('msg')}")
    return "invalid request: " + "; ".join(parts)

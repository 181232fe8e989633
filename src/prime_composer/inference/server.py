"""The ``hf`` backend's HTTP server: FastAPI app, admin endpoints, error format, ``serve``.

Endpoints: the OpenAI-compatible ones (``openai_routes``), ``GET /health``, and the admin
endpoints ``POST /update_weights {"path": ...}`` and ``POST /reload_weights`` (shared secret, see
``auth``). ``/update_weights`` only reads ``step_<N>`` directories published (``STABLE``) under
``<output_dir>/broadcasts``; the path is resolved (symlinks included) before that check.

Every client error is a 4xx with OpenAI's error body ``{"error": {"message", "type", "param",
"code"}}``; malformed JSON and schema violations are 400 (as vLLM answers them), never a crash.

Usage::

    serve(config)            # blocks; what ``uv run inference`` calls
    app = build_app(config)  # in-process (tests); see ``local.running_server``
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from prime_composer.config.inference import InferenceConfig
from prime_composer.inference.auth import check_bearer, resolve_admin_secret
from prime_composer.inference.engine import Engine
from prime_composer.inference.openai_routes import APIError, ServingState, openai_router
from prime_composer.inference.protocol import UpdateWeightsRequest
from prime_composer.inference.requests import EngineError
from prime_composer.transport.weights import is_stable, load_weights, parse_step

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    422: "BadRequestError",
}


KEEP_ALIVE_S = 75
"""Seconds an idle client connection stays open. Longer than httpx's pool expiry (5 s): with
uvicorn's default of 5 s the server closes idle connections just as clients reuse them, and an
unlucky request fails with a connection error (a lost rollout, seen between slow trainer steps)."""


def broadcast_root(config: InferenceConfig) -> Path:
    """The only directory weight updates are read from."""
    return Path(config.output_dir) / "broadcasts"


def build_app(config: InferenceConfig) -> FastAPI:
    """Load the model and return the app (the decode loop starts with the app's lifespan)."""
    if config.backend != "hf":
        raise ValueError(
            f"inference.backend = {config.backend!r}: build_app serves the embedded 'hf' backend only"
        )
    # Fail on a missing secret before spending time loading the model.
    secret = resolve_admin_secret(config.host, config.secret_env)

    import torch

    from prime_composer.inference.loading import load_model_and_tokenizer, max_context, resolve_device

    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    device = resolve_device(config.device)
    model, tokenizer = load_model_and_tokenizer(config.model, device)
    engine = Engine(
        model,
        tokenizer,
        max_model_len=max_context(model, config.max_model_len),
        max_num_seqs=config.max_num_seqs,
        max_prefill_tokens=config.max_prefill_tokens,
        seed=config.seed,
    )
    state = ServingState(
        engine=engine,
        tokenizer=tokenizer,
        served_model_name=config.served_model_name or config.model.name,
        model_root=str(getattr(model, "name_or_path", config.model.name)),
    )
    return create_app(state, broadcast_root(config), secret)


def create_app(state: ServingState, weights_root: Path, secret: str | None) -> FastAPI:
    """The FastAPI app around an already-built engine (``build_app`` does the loading)."""
    engine = state.engine

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)

    app = FastAPI(title="prime-composer inference (hf)", lifespan=lifespan)
    app.include_router(openai_router(state))
    _install_error_handlers(app)
    update_lock = asyncio.Lock()
    current: dict[str, Any] = {"path": None, "step": None}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": state.served_model_name, "weights": dict(current)}

    @app.post("/update_weights")
    async def update_weights(request: Request) -> dict[str, Any]:
        check_bearer(request, secret)
        try:
            body = UpdateWeightsRequest.model_validate(await _json_body(request))
        except ValidationError as e:
            raise APIError(400, _describe_validation(e.errors())) from e
        path = _checked_weight_path(body.path, weights_root)
        async with update_lock:
            try:
                state_dict = await asyncio.to_thread(load_weights, path)
                engine.check_state_dict(state_dict)
            except (FileNotFoundError, ValueError, OSError) as e:
                raise APIError(400, f"cannot load weights from {path}: {e}") from e
            await engine.update_weights(state_dict)
            current.update(path=str(path), step=parse_step(path))
        logger.info("serving weights from %s", path)
        return {"status": "ok", **current}

    @app.post("/reload_weights")
    async def reload_weights(request: Request) -> dict[str, Any]:
        check_bearer(request, secret)
        async with update_lock:
            await engine.update_weights(None)
            current.update(path=None, step=None)
        logger.info("serving the base weights again")
        return {"status": "ok", **current}

    return app


async def _json_body(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from e


def _checked_weight_path(raw: str, root: Path) -> Path:
    """Resolve ``raw`` (relative paths are under ``root``) and refuse anything outside ``root``."""
    root = root.resolve()
    candidate = Path(raw).expanduser()
    path = (candidate if candidate.is_absolute() else root / candidate).resolve()
    if path == root or not path.is_relative_to(root):
        raise APIError(
            403,
            f"weight path {raw!r} is outside the broadcast root {root}: only step directories "
            "published there by the trainer are accepted",
            "PermissionDeniedError",
        )
    if not path.is_dir():
        raise APIError(404, f"weight directory {path} does not exist", "NotFoundError")
    if not is_stable(path):
        raise APIError(
            409, f"weight directory {path} has no STABLE marker (still being written?)", "ConflictError"
        )
    return path


def _error(status: int, message: str, error_type: str | None = None) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": error_type or _ERROR_TYPES.get(status, "Error"),
            "param": None,
            "code": status,
        }
    }
    return JSONResponse(body, status_code=status)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return _error(e.status, e.message, e.error_type)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, e: RequestValidationError) -> JSONResponse:
        return _error(400, _describe_validation(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error(e.status_code, str(e.detail))

    @app.exception_handler(EngineError)
    async def engine_error(_: Request, e: EngineError) -> JSONResponse:
        return _error(500, str(e), "InternalServerError")


def _describe_validation(errors: Any) -> str:
    parts = []
    for error in list(errors)[:5]:
        if error.get("type") == "json_invalid":
            return (
                f"the request body is not valid JSON: {error.get('ctx', {}).get('error', error.get('msg'))}"
            )
        location = ".".join(str(x) for x in error.get("loc", ()) if x != "body")
        parts.append(f"{location or 'body'}: {error.get('msg')}")
    return "invalid request: " + "; ".join(parts)


def serve(config: InferenceConfig) -> None:
    """Load the model and serve until interrupted (blocks)."""
    import uvicorn

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(config)
    if config.secret_env:
        # The variable's name only; its value is never logged.
        logger.info("admin endpoints require the secret in $%s", config.secret_env)
    logger.info(
        "serving %s on http://%s:%d (pid %d)", config.model.name, config.host, config.port, os.getpid()
    )
    uvicorn.run(app, host=config.host, port=config.port, log_level="info", timeout_keep_alive=KEEP_ALIVE_S)

"""The ``hf`` backend's HTTP server: FastAPI app, admin endpoints, error format, ``serve``.

Endpoints: the OpenAI-compatible ones (``openai_routes``), ``GET /health``, ``GET /metrics``
(Prometheus text: tool-call counters), and the admin endpoints ``POST /update_weights {"path": ...}``
and ``POST /reload_weights``.

Every request first passes ``guard.RequestGuard``: with a secret configured (``auth``) every route
but ``/health`` needs it, and bodies over ``inference.max_request_bytes`` are a 413.
``/update_weights`` only reads ``step_<N>`` directories published (``STABLE``) under
``<output_dir>/broadcasts`` (``weight_paths``: the path is resolved, symlinks included, before
that check), verifies their digests and that every value is finite (``transport.weights``), and
refuses content problems with 409. A LoRA step (``transport/adapter.py``) is merged onto the
base weights first (``weight_swap``), so it is served like whole weights.

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
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from prime_composer.config.inference import InferenceConfig
from prime_composer.inference.auth import resolve_admin_secret
from prime_composer.inference.guard import DEFAULT_MAX_BODY_BYTES, APIError, RequestGuard, error_response
from prime_composer.inference.hf.engine import Engine
from prime_composer.inference.local import KEEP_ALIVE_S
from prime_composer.inference.openai_routes import ServingState, openai_router
from prime_composer.inference.preprocess import Preprocessor
from prime_composer.inference.requests import EngineError
from prime_composer.inference.weight_updates import WeightUpdates
from prime_composer.transport.adapter import load_adapter
from prime_composer.transport.weights import load_weights

logger = logging.getLogger(__name__)


def broadcast_root(config: InferenceConfig) -> Path:
    """The only directory weight updates are read from."""
    return Path(config.output_dir) / "broadcasts"


def build_app(config: InferenceConfig) -> FastAPI:
    """Load the model and return the app (the decode loop starts with the app's lifespan)."""
    # Fail on a missing secret before spending time loading the model.
    secret = resolve_admin_secret(config.host, config.secret_env)
    remote = _remote(config)

    import torch

    from prime_composer.inference.hf.loading import load_model_and_tokenizer, max_context, resolve_device

    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    device = resolve_device(config.device)
    model, tokenizer = load_model_and_tokenizer(config.model, device)
    max_model_len = max_context(model, config.max_model_len)
    engine = Engine(
        model,
        tokenizer,
        max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_prefill_tokens=config.max_prefill_tokens,
        seed=config.seed,
    )
    state = ServingState(
        engine=engine,
        tokenizer=tokenizer,
        served_model_name=config.served_model_name or config.model.name,
        model_root=str(getattr(model, "name_or_path", config.model.name)),
        preprocess=Preprocessor(
            tokenizer,
            max_model_len=max_model_len,
            num_threads=config.num_preprocess_threads,
            timeout_s=config.preprocess_timeout_s,
            allow_client_template=config.allow_client_chat_template,
        ),
        tool_call_parser=config.tool_call_parser,
    )
    _check_tool_format(tokenizer, config.tool_call_parser)
    return create_app(
        state,
        broadcast_root(config),
        secret,
        config.max_request_bytes,
        remote,
        private_network=config.private_network,
        audience=config.audience,
    )


def _remote(config: InferenceConfig) -> Any:
    """The ``RemoteWeights`` of ``inference.weights_origin``, or None (a shared folder)."""
    if config.weights_origin is None:
        return None
    from prime_composer.transport.remote import RemoteWeights, url_and_pin

    assert config.weights_secret_env is not None  # the config's validator
    secret = os.environ.get(config.weights_secret_env, "")
    if not secret:
        raise ValueError(f"inference.weights_secret_env = {config.weights_secret_env!r} is unset or empty")
    url, pin = url_and_pin(config.weights_origin)
    relays = tuple(url_and_pin(r) for r in config.weights_relays)
    return RemoteWeights(url, pin, secret.encode(), relays=relays)


def create_app(
    state: ServingState,
    weights_root: Path,
    secret: str | None,
    max_request_bytes: int = DEFAULT_MAX_BODY_BYTES,
    remote: Any = None,
    *,
    private_network: bool = False,
    audience: str | None = None,
) -> FastAPI:
    """The FastAPI app around an already-built engine (``build_app`` does the loading);
    ``remote``: a ``transport.remote.RemoteWeights`` that weight updates fetch from;
    ``private_network``, ``audience``: ``inference.*`` (``guard.RequestGuard``)."""
    engine = state.engine

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            if state.preprocess is not None:
                state.preprocess.close()
            await asyncio.to_thread(engine.stop)

    app = FastAPI(title="prime-composer inference (hf)", lifespan=lifespan)
    app.add_middleware(
        RequestGuard,
        secret=secret,
        max_body_bytes=max_request_bytes,
        private_network=private_network,
        audience=audience,
    )
    app.include_router(openai_router(state))
    _install_error_handlers(app)
    updates = WeightUpdates(weights_root, remote)
    weights = _EngineWeights(engine)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": state.served_model_name, "weights": dict(updates.current)}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.tool_stats.prometheus(), media_type="text/plain; version=0.0.4")

    @app.post("/update_weights")
    async def update_weights(request: Request) -> dict[str, Any]:
        return await updates.update(await request.body(), weights)

    @app.post("/reload_weights")
    async def reload_weights() -> dict[str, Any]:
        return await updates.reload(weights)

    return app


class _EngineWeights:
    """The ``WeightTarget`` of the hf server: files are read and verified on a thread (the engine
    keeps decoding), then swapped in between two iterations of the decode loop."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def load_weights(self, path: Path) -> None:
        state_dict = await self._checked(path, adapter=False)
        await self.engine.update_weights(state_dict)

    async def load_adapter(self, path: Path) -> None:
        state_dict = await self._checked(path, adapter=True)
        await self.engine.update_weights(state_dict)

    async def reload_base(self) -> None:
        await self.engine.update_weights(None)

    async def _checked(self, path: Path, adapter: bool) -> Any:
        """The state dict to serve for a published step (an adapter merged onto the base weights);
        every content problem is a 409 naming it."""
        try:
            if adapter:
                loaded = await asyncio.to_thread(load_adapter, path)
                state_dict = await asyncio.to_thread(self.engine.adapter_state_dict, loaded)
            else:
                state_dict = await asyncio.to_thread(load_weights, path)
        except FileNotFoundError as e:  # pruned by the trainer since the path was checked
            raise APIError(404, str(e)) from None
        except Exception as e:  # digest mismatch, NaN/inf, unreadable safetensors, ...
            raise APIError(409, f"refused the weights in {path}: {type(e).__name__}: {e}") from None
        try:
            self.engine.check_state_dict(state_dict)
        except ValueError as e:
            raise APIError(409, f"refused the weights in {path}: {e}") from None
        return state_dict


def _check_tool_format(tokenizer: Any, parser_name: str | None) -> None:
    """Say at start what tool calls will do with this model, rather than at the first request."""
    from prime_composer.inference.tools import template_reads_tools
    from prime_composer.tool_calls import get_parser

    if parser_name is None:
        return
    if not template_reads_tools(getattr(tokenizer, "chat_template", None)):
        logger.warning(
            "this model's chat template does not render tools: chat requests with tools will be refused"
        )
    parser = get_parser(parser_name)
    markers = {str(m) for m in (getattr(parser, "OPEN", None), getattr(parser, "CLOSE", None)) if m}
    special = sorted(markers & set(getattr(tokenizer, "all_special_tokens", ())))
    if special:
        logger.warning(
            "the tool-call markers %s are special tokens of this tokenizer: requests with tools must send "
            "skip_special_tokens = false, or the markers are dropped from the text before parsing",
            special,
        )


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        headers = {"Retry-After": "1"} if e.status == 429 else None
        return e.response(headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(400, _describe_validation(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        message = str(e.detail)
        if e.__cause__ is not None:  # FastAPI's "error parsing the body": say what the error was
            message += f": {type(e.__cause__).__name__}: {str(e.__cause__)[:300]}"
        return error_response(e.status_code, message)

    @app.exception_handler(EngineError)
    async def engine_error(_: Request, e: EngineError) -> JSONResponse:
        return error_response(500, str(e), "InternalServerError")


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
    tls: dict[str, Any] = {}
    if config.tls_cert is not None:
        from prime_composer.wire.tls import fingerprint_of_pem, server_context

        server_context(
            config.tls_cert, config.tls_key or config.tls_cert, ("inference.tls_cert", "inference.tls_key")
        )
        tls = {"ssl_certfile": str(config.tls_cert), "ssl_keyfile": str(config.tls_key)}
        logger.info("TLS certificate %s", fingerprint_of_pem(config.tls_cert))
    app = build_app(config)
    if config.secret_env:
        # The variable's name only; its value is never logged.
        logger.info("every route but /health requires the secret in $%s", config.secret_env)
    scheme = "https" if tls else "http"
    logger.info(
        "serving %s on %s://%s:%d (pid %d)", config.model.name, scheme, config.host, config.port, os.getpid()
    )
    uvicorn.run(
        app, host=config.host, port=config.port, log_level="info", timeout_keep_alive=KEEP_ALIVE_S, **tls
    )

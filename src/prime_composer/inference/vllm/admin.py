"""The admin routes of the ``vllm`` backend, served inside vLLM's own API server process.

vLLM is started with ``--middleware prime_composer.inference.vllm.admin.AdminRoutesMiddleware``
(a documented vLLM server option: a class given there is added with ``app.add_middleware``). This
pure ASGI middleware first applies the ``hf`` server's ``guard.RequestGuard`` to every request
(with a secret configured, every path but ``/health`` needs it, vLLM's own generation routes and
``/v1/models`` included; bodies over ``inference.max_request_bytes`` are a 413), then answers three
paths itself and passes every other request, streaming included, to vLLM untouched:

- ``POST /update_weights {"path": ...}``: check the path (``weight_paths``) and the digests of the
  weight files (``transport.weights.verify_published``, in a thread, while vLLM keeps serving);
  then pause scheduling until the running requests finish (``pause_generation(mode="wait")``:
  every completion comes from one set of weights, as with the ``hf`` backend), run
  ``WeightUpdateExtension.prime_composer_load_weights`` on every worker via
  ``engine_client.collective_rpc`` (it refuses non-finite or truncated weights before touching
  the model), drop the prefix cache (its KV blocks were computed with the old weights), resume.
  With ``--data-parallel-size`` > 1 each of these calls reaches every engine, and the workers'
  answers are gathered from all of them (``every_worker``), so the update is answered once every
  engine serves the step;
- ``POST /update_weights`` naming a LoRA step (``transport/adapter.py``, vLLM started with
  ``--enable-lora``): vLLM's own adapter loading (``OpenAIServingModels.load_lora_adapter``, what
  its ``/v1/load_lora_adapter`` route runs, without that route's development-only switch) loads it
  under ``ADAPTER_NAME``, in place of the previous step's, between requests; from then on every
  generation request for the served model has its ``model`` rewritten to the adapter, so the
  orchestrator keeps asking for the model by its name. vLLM applies the adapter to its base
  weights itself (``W0 + scale * B @ A``, never on top of the previous adapter);
- ``POST /reload_weights``: the same with the base weights (and no adapter);
- ``GET /health``: vLLM's engine health check, answered with the ``hf`` backend's body
  ``{"status", "model", "weights": {"path", "step"}}``;
- ``POST /v1/chat/completions``: checked with OpenAI's rules first (``chat_checks``: a 400 for
  a ``tool`` message answering no call, invalid tool names or schemas, unknown fields, ...), then
  passed to vLLM, its reply filtered for calls of functions that were not offered; ``GET
  /metrics`` gets the count of those calls appended.

Both weight routes run through ``weight_updates.WeightUpdates`` (the same handler as the ``hf``
server's: path checks, adapter or whole weights, one update at a time, what ``/health`` reports),
with ``_VLLMWeights`` as the target. The contract is the ``hf`` server's: same bodies, same error format
``{"error": {"message", "type", "param", "code"}}`` and codes (400 malformed body or path, 401
missing or wrong secret, 403 a path outside ``<output_dir>/broadcasts``, 404 missing, 409 no
``STABLE``, a digest mismatch, non-finite values; 413 too large).

Why a middleware rather than the alternatives: a front process proxying ``/v1/*`` to vLLM adds a
hop and must re-implement streaming and errors; vLLM's dev-mode ``/collective_rpc`` route would
expose arbitrary worker calls without our secret; building vLLM's app from its Python internals
would copy code that changes every release; vLLM's endpoint plugins need an installed entry point
and an allowlist (``VLLM_PLUGINS``) that also filters every other vLLM plugin. The middleware
runs before vLLM's routing, so these paths win over vLLM's own routes of the same name (vLLM
0.32 has its own ``/update_weights`` for NCCL weight transfer, with another body).

Settings come from the launcher through the environment variable ``PRIME_COMPOSER_VLLM_ADMIN``
(JSON: ``broadcast_root``, ``secret_env``, ``served_model_name``, ``max_request_bytes``,
``private_network``, ``audience``, ``weights_origin``: then each step ``/update_weights`` names is
fetched from the weights relays listed with it, in order, then the trainer side's weights origin,
and verified first, as on the ``hf`` backend); the
secret itself is read from the variable named by ``secret_env``, never passed on a command line.
The launcher imports this module too (for those settings), so torch is only imported where a
route needs it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prime_composer.inference.conformance import check_chat_body
from prime_composer.inference.guard import DEFAULT_MAX_BODY_BYTES, APIError, RequestGuard, error_response
from prime_composer.inference.vllm.chat_checks import (
    ReplyFilter,
    UnknownCallStats,
    bind_forced_arguments,
    offered_tools,
    vllm_chat_fields,
)
from prime_composer.inference.weight_updates import WeightUpdates

logger = logging.getLogger(__name__)

SETTINGS_ENV = "PRIME_COMPOSER_VLLM_ADMIN"
LOAD_METHOD = "prime_composer_load_weights"
RELOAD_METHOD = "prime_composer_reload_base_weights"
ADAPTER_NAME = "prime-composer-lora"
"""The name the trainer's newest LoRA adapter is loaded under; requests for the served model are
routed to it (vLLM refuses an adapter named like the base model)."""
GENERATION_ROUTES = {("POST", "/v1/chat/completions"), ("POST", "/v1/completions")}


def admin_settings(
    broadcast_root: Path,
    secret_env: str | None,
    served_model_name: str,
    max_request_bytes: int = DEFAULT_MAX_BODY_BYTES,
    *,
    private_network: bool = False,
    audience: str | None = None,
    weights_origin: dict[str, Any] | None = None,
) -> str:
    """The value of ``PRIME_COMPOSER_VLLM_ADMIN`` the launcher sets for vLLM's process
    (``weights_origin``: ``{"url", "fingerprint", "secret_env", "relays"}`` of
    ``inference.weights_origin`` and ``inference.weights_relays``, each relay ``[url, fingerprint]``)."""
    return json.dumps(
        {
            "weights_origin": weights_origin,
            "private_network": private_network,
            "audience": audience,
            "broadcast_root": str(Path(broadcast_root).resolve()),
            "secret_env": secret_env,
            "served_model_name": served_model_name,
            "max_request_bytes": max_request_bytes,
        }
    )


def _remote(origin: dict[str, Any] | None) -> Any:
    """The ``transport.remote.RemoteWeights`` weight updates fetch from (None: a shared folder)."""
    if not origin:
        return None
    from prime_composer.transport.remote import RemoteWeights

    secret = os.environ.get(origin["secret_env"] or "", "")
    if not secret:
        raise ValueError(f"inference.weights_secret_env = {origin['secret_env']!r} is unset or empty")
    relays = tuple((str(url), None if pin is None else str(pin)) for url, pin in origin.get("relays") or ())
    return RemoteWeights(origin["url"], origin["fingerprint"], secret.encode(), relays=relays)


class AdminRoutesMiddleware:
    """ASGI middleware adding the request guard, the weight-update routes and ``/health`` to
    vLLM's server."""

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
        self.updates = WeightUpdates(self.broadcast_root, _remote(settings.get("weights_origin")))
        self.adapter: str | None = None  # the LoRA adapter generation requests are routed to
        self.unknown_calls = UnknownCallStats()
        self._chat_fields: frozenset[str] | bool | None = False  # False: not looked up yet
        self._lock: asyncio.Lock | None = None  # made lazily, inside the server's event loop
        self._guarded = RequestGuard(
            self._dispatch,
            secret=self.secret,
            max_body_bytes=int(settings.get("max_request_bytes", DEFAULT_MAX_BODY_BYTES)),
            private_network=bool(settings.get("private_network", False)),
            audience=settings.get("audience"),
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._guarded(scope, receive, send)

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = (scope.get("method"), scope.get("path")) if scope["type"] == "http" else None
        handler = {
            ("POST", "/update_weights"): self._update_weights,
            ("POST", "/reload_weights"): self._reload_weights,
            ("GET", "/health"): self._health,
        }.get(route)  # type: ignore[arg-type]
        if handler is None:
            if route is not None and route[1] in ("/update_weights", "/reload_weights"):
                await error_response(405, f"{route[1]} takes POST")(scope, receive, send)
                return
            if route == ("POST", "/v1/chat/completions"):
                await self._chat(scope, receive, send)
                return
            if self.adapter is not None and route in GENERATION_ROUTES:
                await self._to_adapter(scope, receive, send, self.adapter)
                return
            if route == ("GET", "/metrics"):
                await self.app(scope, receive, _appending(send, self.unknown_calls.prometheus().encode()))
                return
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            response = await handler(request)
        except APIError as e:
            response = error_response(e.status, e.message, e.error_type)
        await response(scope, receive, send)

    async def _health(self, request: Request) -> JSONResponse:
        try:
            await _engine(request).check_health()
        except Exception as e:  # the engine died: the same 503 vLLM's own /health answers
            raise APIError(503, f"the vLLM engine is not healthy: {e}") from e
        return JSONResponse(
            {"status": "ok", "model": self.served_model_name, "weights": dict(self.updates.current)}
        )

    async def _update_weights(self, request: Request) -> JSONResponse:
        body = await request.body()
        return JSONResponse(await self.updates.update(body, _VLLMWeights(self, request)))

    async def _reload_weights(self, request: Request) -> JSONResponse:
        return JSONResponse(await self.updates.reload(_VLLMWeights(self, request)))

    async def _load_adapter(self, request: Request, path: Path) -> None:
        """Load the LoRA adapter at ``path`` as ``ADAPTER_NAME`` in place of the previous one
        (vLLM's own ``load_lora_adapter``, what its ``/v1/load_lora_adapter`` route runs), between
        requests, then route generation to it. vLLM refusing it is a 409 with its message."""
        models = request.app.state.openai_serving_models
        engine = _engine(request)
        async with self._swap_lock():
            await engine.pause_generation(mode="wait")
            try:
                result = await models.load_lora_adapter(
                    load_adapter_request(ADAPTER_NAME, str(path), load_inplace=self.adapter is not None)
                )
                error = getattr(result, "error", None)
                if error is not None:
                    raise APIError(409, f"vLLM refused the adapter in {path}: {error.message}")
                self.adapter = ADAPTER_NAME
                await engine.reset_prefix_cache()  # cached blocks were computed with the old adapter
            finally:
                await engine.resume_generation()

    async def _unload_adapter(self, request: Request) -> None:
        """Stop routing to the adapter (before whole weights or the base weights are served)."""
        if self.adapter is None:
            return
        await request.app.state.openai_serving_models.unload_lora_adapter(
            unload_adapter_request(self.adapter)
        )
        self.adapter = None

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A chat request, checked (``chat_checks``) before vLLM sees it; its reply filtered for
        calls of functions that were not offered."""
        raw = await _read_body(receive)
        if raw is None:
            return
        try:
            data = json.loads(raw)
        except ValueError:
            data = None  # vLLM answers a malformed body itself
        offered = None
        if isinstance(data, dict):
            if self._chat_fields is False:
                self._chat_fields = vllm_chat_fields()
            try:
                await asyncio.to_thread(check_chat_body, data, self._chat_fields or None)
            except APIError as e:
                await e.response()(scope, receive, send)
                return
            offered = offered_tools(data)
            if bind_forced_arguments(data):
                raw = json.dumps(data).encode()
        if self.adapter is not None:
            raw = route_to_adapter(raw, self.served_model_name, self.adapter)
        if offered is not None:
            send = _filtering(send, ReplyFilter(offered, self.unknown_calls))
        await self._replay(scope, receive, send, raw)

    async def _to_adapter(self, scope: Scope, receive: Receive, send: Send, adapter: str) -> None:
        """Pass a generation request to vLLM with its ``model`` set to ``adapter``: the whole body
        is read (the guard has already bounded its size), rewritten and replayed."""
        raw = await _read_body(receive)
        if raw is None:
            return
        await self._replay(scope, receive, send, route_to_adapter(raw, self.served_model_name, adapter))

    async def _replay(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as vLLM expects

        await self.app(scope, replay, send)

    def _swap_lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def _swap(self, request: Request, method: str, args: tuple[Any, ...]) -> None:
        """Run ``method`` on every worker between requests, then forget cached KV blocks.

        A worker that refuses the weights before touching its model (``{"refused": message}``)
        makes this a 409 with its message; any other worker failure is a 500.
        """
        engine = _engine(request)
        async with self._swap_lock():
            await engine.pause_generation(mode="wait")
            try:
                try:
                    results = await every_worker(engine, method, args)
                except Exception as e:
                    logger.exception("%s failed", method)
                    raise APIError(500, f"{method} failed in the vLLM workers: {e}") from e
                refusals = [r["refused"] for r in results if isinstance(r, dict) and r.get("refused")]
                if refusals and len(refusals) < len(results):  # the files changed under the load
                    raise APIError(
                        500,
                        f"{len(refusals)} of {len(results)} vLLM workers refused {args[0]} ({refusals[0]}) "
                        "and the others loaded it: the workers now disagree; restart the server",
                    )
                if refusals:
                    raise APIError(409, f"refused the weights in {args[0]}: {refusals[0]}")
                # Cached prefixes hold keys/values computed by the old weights.
                await engine.reset_prefix_cache()
            finally:
                await engine.resume_generation()


async def every_worker(engine: Any, method: str, args: tuple[Any, ...]) -> list[Any]:
    """Run ``method`` on every worker of every data-parallel engine; one result per worker.

    ``collective_rpc`` reaches every engine with ``--data-parallel-size`` > 1 too (vLLM's
    data-parallel client sends each utility call to all of them), but returns the first engine's
    results only (vLLM 0.32, ``DPLBAsyncMPClient.call_utility_async``), so a refusal by another
    engine would go unseen. The engine core client's ``call_utility_all_async`` returns each
    engine's; without it (another vLLM, a test double) ``collective_rpc``'s list is all there is.
    """
    call_all = getattr(getattr(engine, "engine_core", None), "call_utility_all_async", None)
    if call_all is None:
        return list(await engine.collective_rpc(method, args=args) or ())
    per_engine = await call_all("collective_rpc", method, None, args, None)
    return [result for results in per_engine for result in (results or ())]


class _VLLMWeights:
    """The ``WeightTarget`` of one admin request: digests are verified before vLLM pauses (a
    corrupted file is refused while it keeps serving, and the pause does not pay for hashing; the
    workers check sizes and finite values themselves), then the middleware loads through the
    workers or vLLM's LoRA loading."""

    def __init__(self, middleware: AdminRoutesMiddleware, request: Request) -> None:
        self.middleware, self.request = middleware, request

    async def load_weights(self, path: Path) -> None:
        await _verified(path)
        await self.middleware._unload_adapter(self.request)
        await self.middleware._swap(self.request, LOAD_METHOD, (str(path),))

    async def load_adapter(self, path: Path) -> None:
        await _verified(path)
        await self.middleware._load_adapter(self.request, path)

    async def reload_base(self) -> None:
        await self.middleware._unload_adapter(self.request)
        await self.middleware._swap(self.request, RELOAD_METHOD, ())


async def _verified(path: Path) -> None:
    # Imported here: it imports torch, which the launcher (importing this module) never needs.
    from prime_composer.transport.weights import verify_published

    try:
        await asyncio.to_thread(verify_published, path)
    except FileNotFoundError as e:
        raise APIError(404, str(e)) from None
    except (ValueError, OSError) as e:
        raise APIError(409, f"refused the weights in {path}: {type(e).__name__}: {e}") from None


def route_to_adapter(body: bytes, served_model_name: str, adapter: str) -> bytes:
    """``body`` with its ``model`` set to ``adapter`` when it names the served model (or none,
    which vLLM reads as the served model); any other body is returned as it is, for vLLM to
    answer (a malformed one gets vLLM's own 400, another model name its own 404)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body
    if not isinstance(data, dict) or data.get("model", served_model_name) != served_model_name:
        return body
    return json.dumps({**data, "model": adapter}).encode()


def load_adapter_request(name: str, path: str, load_inplace: bool) -> Any:
    """vLLM's ``LoadLoRAAdapterRequest`` (imported here: only vLLM's own process has vLLM)."""
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    return LoadLoRAAdapterRequest(lora_name=name, lora_path=path, load_inplace=load_inplace)


def unload_adapter_request(name: str) -> Any:
    """vLLM's ``UnloadLoRAAdapterRequest`` for adapter ``name``."""
    from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

    return UnloadLoRAAdapterRequest(lora_name=name)


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body (the guard has bounded its size); ``None`` if the client left."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _filtering(send: Send, reply: ReplyFilter) -> Send:
    """``send`` with a chat reply rewritten by ``reply``: a whole JSON body is held until complete
    (its length changes), an event stream rewritten event by event."""
    start: Message | None = None
    streaming = False
    held: list[bytes] = []

    async def filtered(message: Message) -> None:
        nonlocal start, streaming
        if message["type"] == "http.response.start":
            headers = dict((k.lower(), v) for k, v in message.get("headers", []))
            if message.get("status") != 200:
                start = None
                await send(message)
                return
            streaming = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            if streaming:
                await send(message)
            else:
                start = message
            return
        if message["type"] != "http.response.body":
            await send(message)
            return
        more = message.get("more_body", False)
        if streaming:
            await send({**message, "body": reply.chunk(message.get("body", b""), final=not more)})
            return
        if start is None:  # an error answer: passed as it is
            await send(message)
            return
        held.append(message.get("body", b""))
        if more:
            return
        body = reply.whole(b"".join(held))
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return filtered


def _appending(send: Send, extra: bytes) -> Send:
    """``send`` with ``extra`` appended to a successful response's body (``/metrics``)."""
    ok = False

    async def appending(message: Message) -> None:
        nonlocal ok
        if message["type"] == "http.response.start":
            ok = message.get("status") == 200
            if ok:
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"content-length"]
                message = {**message, "headers": headers}
        elif message["type"] == "http.response.body" and ok and not message.get("more_body", False):
            message = {**message, "body": message.get("body", b"") + extra}
        await send(message)

    return appending


def _engine(request: Request) -> Any:
    """vLLM's engine client, which its own routes also read from the app state."""
    return request.app.state.engine_client

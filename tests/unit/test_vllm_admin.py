"""The vllm backend's admin routes (inference/vllm/admin.py) with a fake vLLM engine client.

Checks the order of engine calls around a weight swap, pass-through of every other request, and
that every request gets the same status code and error body shape from this middleware as from
the embedded hf server (the contract the orchestrator relies on). LoRA steps go through vLLM's
adapter loading (a fake ``OpenAIServingModels``) and generation requests are routed to the adapter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from prime_composer.inference.vllm import admin
from prime_composer.inference.vllm.admin import (
    ADAPTER_NAME,
    LOAD_METHOD,
    RELOAD_METHOD,
    SETTINGS_ENV,
    AdminRoutesMiddleware,
    admin_settings,
    route_to_adapter,
)
from prime_composer.inference.vllm.extension import WeightUpdateExtension
from prime_composer.integrity import write_manifest
from prime_composer.transport.adapter import publish_adapter
from prime_composer.wire.auth import inference_signer

SECRET = "s3cret-value"


class FakeEngine:
    """Records the engine-client calls the middleware makes (vLLM's ``EngineClient`` methods)."""

    def __init__(self, fail_rpc: bool = False, healthy: bool = True, rpc_result: Any = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail_rpc = fail_rpc
        self.healthy = healthy
        self.rpc_result = rpc_result if rpc_result is not None else {"num_tensors": 1}

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.calls.append(("pause", mode))

    async def resume_generation(self) -> None:
        self.calls.append(("resume",))

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (), kwargs=None):
        self.calls.append(("rpc", method, args))
        if self.fail_rpc:
            raise RuntimeError("worker exploded")
        return [self.rpc_result]

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False):
        self.calls.append(("reset_prefix_cache",))
        return True

    async def check_health(self) -> None:
        if not self.healthy:
            raise RuntimeError("engine dead")


def _publish_dir(root: Path, step: int, stable: bool = True) -> Path:
    """A step directory as ``publish_weights`` leaves it (the fake workers never read it)."""
    path = root / f"step_{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"weights of step %d" % step)
    write_manifest(path)
    if stable:
        (path / "STABLE").write_text("{}")
    return path


def _app(root: Path, engine: FakeEngine, secret_env: str | None = None) -> TestClient:
    async def models(_request: Any) -> JSONResponse:  # stands for every vLLM route
        return JSONResponse({"object": "list", "data": [{"id": "m"}]})

    app = Starlette(routes=[Route("/v1/models", models), Route("/health", models)])
    app.state.engine_client = engine
    settings = {"broadcast_root": str(root), "secret_env": secret_env, "served_model_name": "m"}
    app.add_middleware(AdminRoutesMiddleware, settings=settings)
    return TestClient(app)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "out" / "broadcasts"
    root.mkdir(parents=True)
    return root


def test_update_pauses_loads_on_every_worker_resets_cache_then_resumes(root: Path) -> None:
    step = _publish_dir(root, 3)
    engine = FakeEngine()
    client = _app(root, engine)
    response = client.post("/update_weights", json={"path": str(step)})
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "path": str(step.resolve()), "step": 3}
    assert engine.calls == [
        ("pause", "wait"),
        ("rpc", LOAD_METHOD, (str(step.resolve()),)),
        ("reset_prefix_cache",),
        ("resume",),
    ]
    assert client.get("/health").json() == {
        "status": "ok",
        "model": "m",
        "weights": {"path": str(step.resolve()), "step": 3},
    }

    engine.calls.clear()
    response = client.post("/reload_weights")
    assert response.json() == {"status": "ok", "path": None, "step": None}
    assert engine.calls == [
        ("pause", "wait"),
        ("rpc", RELOAD_METHOD, ()),
        ("reset_prefix_cache",),
        ("resume",),
    ]


def test_relative_path_is_under_the_broadcast_root(root: Path) -> None:
    step = _publish_dir(root, 7)
    engine = FakeEngine()
    response = _app(root, engine).post("/update_weights", json={"path": "step_7"})
    assert response.status_code == 200 and response.json()["path"] == str(step.resolve())


def test_worker_failure_is_a_500_and_generation_resumes(root: Path) -> None:
    _publish_dir(root, 1)
    engine = FakeEngine(fail_rpc=True)
    response = _app(root, engine).post("/update_weights", json={"path": "step_1"})
    assert response.status_code == 500
    assert "worker exploded" in response.json()["error"]["message"]
    assert engine.calls[-1] == ("resume",)


def test_other_requests_pass_through_and_unhealthy_engine_is_503(root: Path) -> None:
    client = _app(root, FakeEngine(healthy=False))
    assert client.get("/v1/models").json()["data"] == [{"id": "m"}]
    response = client.get("/health")
    assert response.status_code == 503 and response.json()["error"]["code"] == 503


def test_method_names_exist_on_the_worker_extension() -> None:
    # collective_rpc calls these by name inside vLLM's workers.
    assert callable(getattr(WeightUpdateExtension, LOAD_METHOD))
    assert callable(getattr(WeightUpdateExtension, RELOAD_METHOD))


def test_settings_come_from_the_environment(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SETTINGS_ENV, raising=False)
    with pytest.raises(ValueError, match=SETTINGS_ENV):
        AdminRoutesMiddleware(app=None)  # type: ignore[arg-type]
    monkeypatch.setenv(SETTINGS_ENV, admin_settings(root, "MY_SECRET_VAR", "m"))
    monkeypatch.delenv("MY_SECRET_VAR", raising=False)
    with pytest.raises(ValueError, match="MY_SECRET_VAR"):
        AdminRoutesMiddleware(app=None)  # type: ignore[arg-type]
    monkeypatch.setenv("MY_SECRET_VAR", SECRET)
    middleware = AdminRoutesMiddleware(app=None)  # type: ignore[arg-type]
    assert middleware.secret == SECRET and middleware.broadcast_root == root.resolve()


# --- the same contract as the hf server --------------------------------------------------------


class _IdleEngine:
    """Enough of the hf engine for requests that fail before reaching it."""

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


def _hf_client(root: Path, secret: str | None) -> TestClient:
    from prime_composer.inference.hf.server import create_app
    from prime_composer.inference.openai_routes import ServingState
    from prime_composer.inference.preprocess import Preprocessor

    state = ServingState(
        engine=_IdleEngine(),  # type: ignore[arg-type]
        tokenizer=None,
        served_model_name="m",
        model_root="m",
        preprocess=Preprocessor(None, max_model_len=16),
    )
    return TestClient(create_app(state, root, secret))


def _cases(root: Path, tmp_path: Path) -> list[tuple[str, str, Any, dict[str, str]]]:
    _publish_dir(root, 2, stable=False)
    outside = _publish_dir(tmp_path / "elsewhere", 5)
    (root / "step_9").symlink_to(outside, target_is_directory=True)
    (root / "loop").symlink_to(root / "loop")
    flipped = _publish_dir(root, 3) / "model.safetensors"
    flipped.write_bytes(flipped.read_bytes()[:-1] + b"X")  # same size, another digest
    latest = root / "latest"
    latest.mkdir()
    (latest / "STABLE").write_text("{}")
    auth = {"Authorization": f"Bearer {SECRET}"}
    return [
        ("NUL byte", "/update_weights", {"path": "step_1\x00"}, auth),
        ("symlink loop", "/update_weights", {"path": "loop"}, auth),
        ("5000 characters", "/update_weights", {"path": "a" * 5000}, auth),
        ("deep JSON", "/update_weights", "[" * 10_000 + "]" * 10_000, auth),
        ("not an object", "/update_weights", "[1, 2]", auth),
        ("path not a string", "/update_weights", {"path": 7}, auth),
        ("not a step directory", "/update_weights", {"path": "latest"}, auth),
        ("digest mismatch", "/update_weights", {"path": "step_3"}, auth),
        ("too large", "/update_weights", {"path": "x" * 9 * 2**20}, auth),
        ("update, no secret", "/update_weights", {"path": "step_1"}, {}),
        ("update, wrong secret", "/update_weights", {"path": "step_1"}, {"Authorization": "Bearer nope"}),
        ("reload, no secret", "/reload_weights", None, {}),
        ("outside the root", "/update_weights", {"path": str(outside)}, auth),
        ("dot-dot escape", "/update_weights", {"path": "../../elsewhere/step_5"}, auth),
        ("symlink escape", "/update_weights", {"path": "step_9"}, auth),
        ("the root itself", "/update_weights", {"path": str(root)}, auth),
        ("missing step", "/update_weights", {"path": "step_4"}, auth),
        ("not STABLE", "/update_weights", {"path": "step_2"}, auth),
        ("no path", "/update_weights", {}, auth),
        ("unknown key", "/update_weights", {"path": "step_2", "force": True}, auth),
        ("not JSON", "/update_weights", "{not json", auth),
    ]


def test_error_codes_and_bodies_match_the_hf_server(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PC_TEST_SECRET", SECRET)
    vllm_client = _app(root, FakeEngine(), secret_env="PC_TEST_SECRET")
    hf_client = _hf_client(root, SECRET)
    for name, route, body, headers in _cases(root, tmp_path):
        kwargs: dict[str, Any] = {"headers": headers}
        if isinstance(body, str):
            kwargs["content"] = body
            kwargs["headers"] = {**headers, "Content-Type": "application/json"}
        elif body is not None:
            kwargs["json"] = body
        ours, theirs = vllm_client.post(route, **kwargs), hf_client.post(route, **kwargs)
        assert ours.status_code == theirs.status_code, (name, ours.json(), theirs.json())
        assert 400 <= ours.status_code < 500, (name, ours.json())
        assert (
            set(ours.json()["error"]) == set(theirs.json()["error"]) == {"message", "type", "param", "code"}
        )
        assert ours.json()["error"]["code"] == ours.status_code
        assert SECRET not in ours.text, name


def test_vllm_routes_need_the_secret_too(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PC_TEST_SECRET", SECRET)
    client = _app(root, FakeEngine(), secret_env="PC_TEST_SECRET")
    for headers in ({}, {"Authorization": "Bearer nope"}):
        response = client.get("/v1/models", headers=headers)  # one of vLLM's own routes
        assert response.status_code == 401 and response.json()["error"]["code"] == 401
    # TestClient's peer is "testclient", another machine: a bearer token is refused from it.
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {SECRET}"}).status_code == 401
    signer = inference_signer(SECRET)
    assert signer is not None
    assert (
        client.get(
            "/v1/models", headers=signer.headers("GET", "http://testserver/v1/models", b"")
        ).status_code
        == 200
    )
    assert client.get("/health").status_code == 200  # the one open route


def test_bodies_over_the_limit_never_reach_vllm(root: Path) -> None:
    app = Starlette(routes=[Route("/v1/completions", lambda _r: JSONResponse({}), methods=["POST"])])
    app.state.engine_client = FakeEngine()
    settings = {
        "broadcast_root": str(root),
        "secret_env": None,
        "served_model_name": "m",
        "max_request_bytes": 1024,
    }
    app.add_middleware(AdminRoutesMiddleware, settings=settings)
    client = TestClient(app)
    assert client.post("/v1/completions", content=b"x" * 1024).status_code == 200
    response = client.post("/v1/completions", content=b"x" * 1025)
    assert response.status_code == 413 and "max_request_bytes = 1024" in response.json()["error"]["message"]


# ------------------------------------------------------------------ LoRA adapters

ADAPTER_CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}


class FakeModels:
    """Records ``load_lora_adapter`` / ``unload_lora_adapter`` calls (vLLM's ``OpenAIServingModels``)."""

    def __init__(self, engine: FakeEngine, refuse: bool = False) -> None:
        self.engine = engine
        self.refuse = refuse

    async def load_lora_adapter(self, request: dict[str, Any]) -> Any:
        self.engine.calls.append(("load_lora", request))
        if self.refuse:
            return type("Error", (), {"error": type("Info", (), {"message": "rank 2 > max_lora_rank"})()})()
        return "Success"

    async def unload_lora_adapter(self, request: dict[str, Any]) -> Any:
        self.engine.calls.append(("unload_lora", request))
        return "Success"


@pytest.fixture
def plain_adapter_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's request models, as dicts: vLLM itself is not installed in this environment.
    monkeypatch.setattr(
        admin, "load_adapter_request", lambda name, path, load_inplace: (name, path, load_inplace)
    )
    monkeypatch.setattr(admin, "unload_adapter_request", lambda name: name)


def _adapter_step(root: Path, step: int) -> Path:
    state = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 8),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(8, 2),
    }
    return publish_adapter(state, ADAPTER_CONFIG, root, step)


def _lora_app(root: Path, engine: FakeEngine, models: FakeModels) -> TestClient:
    async def generate(request: Request) -> JSONResponse:  # stands for vLLM's generation routes
        body = await request.body()
        return JSONResponse({"seen": json.loads(body), "length": request.headers["content-length"]})

    app = Starlette(routes=[Route("/v1/chat/completions", generate, methods=["POST"])])
    app.state.engine_client = engine
    app.state.openai_serving_models = models
    settings = {"broadcast_root": str(root), "secret_env": None, "served_model_name": "m"}
    app.add_middleware(AdminRoutesMiddleware, settings=settings)
    return TestClient(app)


@pytest.mark.usefixtures("plain_adapter_requests")
def test_each_adapter_replaces_the_last_and_requests_are_routed_to_it(tmp_path: Path) -> None:
    root = tmp_path / "broadcasts"
    engine = FakeEngine()
    client = _lora_app(root, engine, FakeModels(engine))
    before = client.post("/v1/chat/completions", json={"model": "m", "messages": []}).json()
    assert before["seen"]["model"] == "m"  # no adapter yet: the base model

    first, second = _adapter_step(root, 1), _adapter_step(root, 2)
    assert client.post("/update_weights", json={"path": str(first)}).status_code == 200
    assert client.post("/update_weights", json={"path": "step_2"}).status_code == 200
    assert engine.calls == [
        ("pause", "wait"),
        ("load_lora", (ADAPTER_NAME, str(first.resolve()), False)),
        ("reset_prefix_cache",),
        ("resume",),
        ("pause", "wait"),
        ("load_lora", (ADAPTER_NAME, str(second.resolve()), True)),  # in place of the first
        ("reset_prefix_cache",),
        ("resume",),
    ]
    assert client.get("/health").json()["weights"]["step"] == 2
    routed = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user"}]}).json()
    assert routed["seen"] == {"model": ADAPTER_NAME, "messages": [{"role": "user"}]}
    assert int(routed["length"]) == len(json.dumps(routed["seen"]))

    # whole weights (or the base weights) drop the adapter first
    engine.calls.clear()
    whole = _publish_dir(root, 3)
    assert client.post("/update_weights", json={"path": str(whole)}).status_code == 200
    assert engine.calls[0] == ("unload_lora", ADAPTER_NAME)
    assert ("rpc", LOAD_METHOD, (str(whole.resolve()),)) in engine.calls
    assert client.post("/v1/chat/completions", json={"model": "m"}).json()["seen"]["model"] == "m"


@pytest.mark.usefixtures("plain_adapter_requests")
def test_refused_adapter_is_a_409_and_generation_resumes(tmp_path: Path) -> None:
    root = tmp_path / "broadcasts"
    engine = FakeEngine()
    client = _lora_app(root, engine, FakeModels(engine, refuse=True))
    response = client.post("/update_weights", json={"path": str(_adapter_step(root, 1))})
    assert response.status_code == 409 and "max_lora_rank" in response.json()["error"]["message"]
    assert engine.calls[-1] == ("resume",)
    assert client.post("/v1/chat/completions", json={"model": "m"}).json()["seen"]["model"] == "m"


def test_only_requests_for_the_served_model_are_rewritten() -> None:
    assert json.loads(route_to_adapter(b'{"model": "m", "n": 2}', "m", "a")) == {"model": "a", "n": 2}
    assert json.loads(route_to_adapter(b'{"n": 2}', "m", "a")) == {"n": 2, "model": "a"}
    assert route_to_adapter(b'{"model": "other"}', "m", "a") == b'{"model": "other"}'
    assert route_to_adapter(b"not json", "m", "a") == b"not json"
    assert route_to_adapter(b"[1, 2]", "m", "a") == b"[1, 2]"


def test_a_vllm_worker_fetches_the_named_step_from_the_weights_origin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``inference.weights_origin`` on the vllm backend: the step is fetched over pinned TLS into
    the worker's own root, its signed manifest and digests checked, then loaded; a step altered
    on the origin's disk is refused before any worker loads it."""
    from prime_composer.config.inference import InferenceConfig
    from prime_composer.inference.vllm.launch import build_vllm_env
    from prime_composer.transport.remote import WeightsOrigin
    from prime_composer.wire.tls import generate, server_context

    trainer_root = tmp_path / "trainer" / "broadcasts"
    _publish_dir(trainer_root, 4)
    _publish_dir(trainer_root, 5)
    pin = generate(tmp_path / "tls", "trainer")
    tls = server_context(tmp_path / "tls" / "cert.pem", tmp_path / "tls" / "key.pem")
    origin = WeightsOrigin(trainer_root, "127.0.0.1", 0, b"weights-secret", tls=tls)
    try:
        monkeypatch.setenv("PC_WEIGHTS_SECRET", "weights-secret")
        config = InferenceConfig(
            backend="vllm",
            output_dir=tmp_path / "worker",
            weights_origin=f"https://127.0.0.1:{origin.port}@{pin}",
            weights_secret_env="PC_WEIGHTS_SECRET",
        )
        settings = json.loads(build_vllm_env(config, base_env={})[admin.SETTINGS_ENV])
        assert "weights-secret" not in json.dumps(settings)
        worker_root = Path(settings["broadcast_root"])
        assert not worker_root.exists() or not any(worker_root.iterdir())
        engine = FakeEngine()
        app = Starlette(routes=[])
        app.state.engine_client = engine
        app.add_middleware(AdminRoutesMiddleware, settings={**settings, "served_model_name": "m"})
        client = TestClient(app)
        response = client.post("/update_weights", json={"path": "step_4"})
        assert response.status_code == 200, response.text
        fetched = worker_root / "step_4"
        assert response.json()["step"] == 4 and (fetched / "STABLE").is_file()
        assert (fetched / "model.safetensors").read_bytes() == b"weights of step 4"
        assert ("rpc", LOAD_METHOD, (str(fetched.resolve()),)) in engine.calls
        # Altered on the origin's disk (same size): the worker refuses it, loads nothing.
        (trainer_root / "step_5" / "model.safetensors").write_bytes(b"weights of step 6")
        engine.calls.clear()
        refused = client.post("/update_weights", json={"path": "step_5"})
        assert refused.status_code == 502 and "does not match its manifest" in refused.text, refused.text
        assert not any(c[0] == "rpc" for c in engine.calls) and not (worker_root / "step_5").exists()
    finally:
        origin.close()

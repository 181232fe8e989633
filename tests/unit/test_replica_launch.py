"""``inference.num_replicas``: ``rl`` resolves one port and URL per replica and starts one service
per replica (its own config, port, log and GPUs), grouped so that losing one does not stop the run."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from prime_composer.config.errors import ConfigError
from prime_composer.config.orchestrator import OrchestratorConfig
from prime_composer.config.resolve import resolve_rl_config
from prime_composer.launch.rl import build_specs, write_resolved_configs

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.toml"


def resolve(tmp_path: Path, *extra: str):  # type: ignore[no-untyped-def]
    config, _ = resolve_rl_config(["@", str(QUICKSTART), "--output-dir", str(tmp_path), *extra])
    return config


def test_one_replica_keeps_a_single_url_and_process(tmp_path: Path) -> None:
    config = resolve(tmp_path)
    assert config.orchestrator.base_url == f"http://127.0.0.1:{config.inference.port}/v1"
    names = [s.name for s in build_specs(config, write_resolved_configs(config))]
    assert names == ["inference", "orchestrator", "trainer"]


def test_each_replica_has_its_own_port_config_and_service(tmp_path: Path) -> None:
    config = resolve(tmp_path, "--inference.num-replicas", "3")
    urls = config.orchestrator.base_url
    assert isinstance(urls, list) and len(urls) == 3
    ports = [urlsplit(u).port for u in urls]
    assert ports[0] == config.inference.port and len(set(ports)) == 3
    paths = write_resolved_configs(config)
    specs = build_specs(config, paths)
    replicas = [s for s in specs if s.name.startswith("inference")]
    assert [s.name for s in replicas] == ["inference-0", "inference-1", "inference-2"]
    assert all(s.kind == "service" and s.group == "inference" for s in replicas)
    for spec, port in zip(replicas, ports, strict=True):
        assert spec.health_url == f"http://127.0.0.1:{port}/health"
        written = json.loads(Path(spec.argv[-1]).read_text())
        assert written["port"] == port and spec.argv[-1].endswith(f"{spec.name}.json")
    assert [s.name for s in specs[3:]] == ["orchestrator", "trainer"]
    # The orchestrator's resolved config lists every replica.
    assert json.loads(paths["orchestrator"].read_text())["base_url"] == urls


def with_gpus(tmp_path: Path, toml: str) -> str:
    path = tmp_path / "gpus.toml"
    path.write_text(f"[inference]\nnum_replicas = 2\n[launch.gpus]\n{toml}\n")
    return str(path)


def test_inference_gpus_are_split_between_replicas(tmp_path: Path) -> None:
    config = resolve(tmp_path, "@", with_gpus(tmp_path, "inference = [3, 5]\ntrainer = [0]"))
    specs = build_specs(config, write_resolved_configs(config))
    assert [s.env.get("CUDA_VISIBLE_DEVICES") for s in specs[:2]] == ["3", "5"]


def test_gpus_that_do_not_split_evenly_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="multiple of 2"):
        resolve(tmp_path, "@", with_gpus(tmp_path, "inference = [0, 1, 2]"))


def test_base_url_takes_a_string_or_a_list() -> None:
    private = {"inference_private_network": True}  # plain HTTP to another host says it is private
    assert OrchestratorConfig(base_url="http://h:1/v1", **private).server_urls == ["http://h:1/v1"]
    assert OrchestratorConfig(base_url=["http://h:1/v1", "http://h:2/v1"], **private).server_urls == [
        "http://h:1/v1",
        "http://h:2/v1",
    ]
    with pytest.raises(ValueError, match="listed twice"):
        OrchestratorConfig(base_url=["http://h:1/v1", "http://h:1/v1"], **private)

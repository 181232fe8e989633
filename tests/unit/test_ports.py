"""No fixed ports: the servers ``rl`` starts take a free port unless the config sets one, and the
resolved configs carry the chosen ones (the orchestrator's URLs follow them)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from prime_composer.config.resolve import resolve_rl_config
from prime_composer.launch.preflight import _port_problems

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@contextlib.contextmanager
def holding(*ports: int) -> Iterator[None]:
    """Listen on ``ports`` on 127.0.0.1 (a port someone else already holds is just as taken)."""
    socks = []
    for port in ports:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen(1)
            socks.append(sock)
        except OSError:
            sock.close()
    try:
        yield
    finally:
        for sock in socks:
            sock.close()


@pytest.mark.parametrize("name", ["quickstart.toml", "quickstart-agentic.toml", "quickstart-replay.toml"])
def test_quickstarts_resolve_around_taken_8000_and_8100(name: str, tmp_path: Path) -> None:
    with holding(8000, 8100):
        config, _ = resolve_rl_config(["@", str(CONFIGS / name), "--output-dir", str(tmp_path)])
        ports = {config.inference.port}
        assert config.orchestrator.base_url == f"http://127.0.0.1:{config.inference.port}/v1"
        if config.teacher is not None:
            ports.add(config.teacher.port)
            assert config.orchestrator.replay.teacher_url == f"http://127.0.0.1:{config.teacher.port}"
        assert not ports & {8000, 8100} and len(ports) == (2 if config.teacher is not None else 1)
        assert _port_problems(config) == []  # the launcher's own check passes: the ports are free


def test_the_chosen_ports_are_in_the_resolved_configs(tmp_path: Path) -> None:
    from prime_composer.launch.rl import write_resolved_configs

    config, _ = resolve_rl_config(
        ["@", str(CONFIGS / "quickstart-replay.toml"), "--output-dir", str(tmp_path)]
    )
    paths = write_resolved_configs(config)
    import json

    inference = json.loads(paths["inference"].read_text())
    orchestrator = json.loads(paths["orchestrator"].read_text())
    teacher = json.loads(paths["teacher"].read_text())
    assert orchestrator["base_url"] == f"http://127.0.0.1:{inference['port']}/v1"
    assert orchestrator["replay"]["teacher_url"] == f"http://127.0.0.1:{teacher['port']}"
    # Rerunning a process alone from its file keeps the port the run used.
    again, _ = resolve_rl_config(["@", str(tmp_path / "configs" / "rl.json")])
    assert (again.inference.port, again.teacher.port) == (inference["port"], teacher["port"])


def test_a_port_in_the_config_is_kept(tmp_path: Path) -> None:
    argv = ["@", str(CONFIGS / "quickstart-replay.toml"), "--output-dir", str(tmp_path)]
    config, _ = resolve_rl_config([*argv, "--inference.port", "8123", "--teacher.port", "8124"])
    assert (config.inference.port, config.teacher.port) == (8123, 8124)
    assert config.orchestrator.base_url == "http://127.0.0.1:8123/v1"
    composer, _ = resolve_rl_config(["@", str(CONFIGS / "composer.toml")])  # sets 8000 and 8100
    assert (composer.inference.port, composer.teacher.port) == (8000, 8100)
    # An orchestrator.base_url given by hand pins the inference port it names.
    pinned, _ = resolve_rl_config([*argv, "--orchestrator.base-url", "http://127.0.0.1:8000/v1"])
    assert pinned.inference.port == 8000


def test_zmq_transport_takes_a_free_port_in_every_section(tmp_path: Path) -> None:
    argv = ["@", str(CONFIGS / "quickstart.toml"), "--output-dir", str(tmp_path), "--transport.kind", "zmq"]
    with holding(5557):
        config, _ = resolve_rl_config(argv)
    port = config.transport.port
    assert port != 5557
    assert config.trainer.transport.port == config.orchestrator.transport.port == port
    assert port != config.inference.port
    fixed, _ = resolve_rl_config([*argv, "--transport.port", "5999"])
    assert fixed.trainer.transport.port == fixed.orchestrator.transport.port == 5999


def test_the_launcher_starts_and_health_checks_the_chosen_ports(tmp_path: Path) -> None:
    from prime_composer.launch.rl import build_specs, write_resolved_configs

    with holding(8000, 8100):
        argv = ["@", str(CONFIGS / "quickstart-replay.toml"), "--output-dir", str(tmp_path)]
        config, _ = resolve_rl_config(argv)
        specs = {s.name: s for s in build_specs(config, write_resolved_configs(config))}
    assert specs["inference"].health_url == f"http://127.0.0.1:{config.inference.port}/health"
    assert specs["teacher"].health_url == f"http://127.0.0.1:{config.teacher.port}/health"
    assert not {config.inference.port, config.teacher.port} & {8000, 8100}

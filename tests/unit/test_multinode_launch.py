"""``launch.nodes``: the keys are validated with errors naming them, each node starts its share of
the trainer's ranks under the c10d rendezvous (node 0 everything else as well), and the
rendezvous stores listen on the configured address only."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from prime_composer.config.errors import ConfigError
from prime_composer.config.resolve import resolve_rl_config
from prime_composer.launch.preflight import preflight
from prime_composer.launch.rl import build_specs, is_head, write_resolved_configs

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.toml"


def resolve(tmp_path: Path, *extra: str):  # type: ignore[no-untyped-def]
    config, _ = resolve_rl_config(["@", str(QUICKSTART), "--output-dir", str(tmp_path), *extra])
    return config


def specs(config, tmp_path: Path):  # type: ignore[no-untyped-def]
    return {s.name: s for s in build_specs(config, write_resolved_configs(config, tmp_path / "cfg"))}


@pytest.mark.parametrize(
    ("flags", "key"),
    [
        (["--launch.nodes", "2", "--launch.node-rank", "2"], "launch.node_rank = 2"),
        (["--launch.nodes", "2", "--launch.rdzv-endpoint", "10.0.0.1"], "launch.rdzv_endpoint"),
        (["--launch.nodes", "2", "--launch.rdzv-endpoint", "10.0.0.1:99999"], "launch.rdzv_endpoint"),
        (["--launch.nodes", "2", "--launch.rdzv-endpoint", "10.0.0.1:29400"], "launch.private_network"),
        (["--launch.nodes", "2", "--trainer.num-ranks", "3"], "trainer.num_ranks = 3"),
        (["--launch.processes", '["trainr"]'], "launch.processes"),
        (["--launch.processes", '["orchestrator", "trainer"]'], "orchestrator.base_url"),
    ],
)
def test_bad_node_settings_name_their_key(tmp_path: Path, flags: list[str], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace("[", r"\[")):
        resolve(tmp_path, "--trainer.num-ranks", "4", *flags)


def test_trainer_gpus_are_counted_per_node(tmp_path: Path) -> None:
    gpus = tmp_path / "gpus.toml"
    gpus.write_text("[launch.gpus]\ninference = [0]\ntrainer = [1, 2]\n")
    config = resolve(tmp_path, "@", str(gpus), "--trainer.num-ranks", "4", "--launch.nodes", "2")
    assert config.launch.gpus["trainer"] == [1, 2]
    with pytest.raises(
        ConfigError, match=r"launch.gpus.trainer has 2 GPUs but trainer.num_ranks = 4 ranks run"
    ):
        resolve(tmp_path, "@", str(gpus), "--trainer.num-ranks", "4")


def _flag(argv: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
    return value


def test_node_zero_runs_everything_and_hosts_the_rendezvous(tmp_path: Path) -> None:
    config = resolve(
        tmp_path,
        "--trainer.num-ranks",
        "4",
        "--launch.nodes",
        "2",
        "--launch.rdzv-endpoint",
        "127.0.0.1:29555",
    )
    assert is_head(config)
    got = specs(config, tmp_path)
    assert list(got) == ["inference", "orchestrator", "trainer"]
    argv = got["trainer"].argv
    assert argv[1:5] == ["-m", "prime_composer.launch.torchrun", "--bind-host", "127.0.0.1"]
    assert _flag(argv, "nnodes") == "2" and _flag(argv, "nproc-per-node") == "2"
    assert _flag(argv, "rdzv-backend") == "c10d" and _flag(argv, "rdzv-endpoint") == "127.0.0.1:29555"
    assert _flag(argv, "rdzv-conf").startswith("is_host=true,")
    assert _flag(argv, "max-restarts") == "0"
    # The orchestrator packs for every rank of every node.
    assert config.orchestrator.num_train_ranks == 4


def test_other_nodes_run_their_ranks_only_and_join_the_same_rendezvous(tmp_path: Path) -> None:
    common = ["--trainer.num-ranks", "4", "--launch.nodes", "2", "--launch.private-network", "true"]
    endpoint = ["--launch.rdzv-endpoint", "10.1.2.3:29400"]
    node0 = resolve(tmp_path, *common, *endpoint)
    node1 = resolve(tmp_path, *common, *endpoint, "--launch.node-rank", "1")
    assert not is_head(node1)
    got0, got1 = specs(node0, tmp_path / "0"), specs(node1, tmp_path / "1")
    assert list(got1) == ["trainer"]
    a0, a1 = got0["trainer"].argv, got1["trainer"].argv
    assert _flag(a0, "rdzv-id") == _flag(a1, "rdzv-id")
    assert _flag(a1, "rdzv-conf") == "is_host=false,join_timeout=1800,read_timeout=1800"
    # Node 0 listens on the endpoint's address, node 1 on the address that reaches it.
    assert a0[a0.index("--bind-host") + 1] == "10.1.2.3"
    assert a1[a1.index("--bind-host") + 1] == "route:10.1.2.3"


def test_one_node_with_several_ranks_keeps_the_rendezvous_on_loopback(tmp_path: Path) -> None:
    argv = specs(resolve(tmp_path, "--trainer.num-ranks", "2"), tmp_path)["trainer"].argv
    assert argv[1:5] == ["-m", "prime_composer.launch.torchrun", "--bind-host", "127.0.0.1"]
    assert "--standalone" in argv and _flag(argv, "nproc-per-node") == "2"


def test_inference_elsewhere_keeps_the_given_urls(tmp_path: Path) -> None:
    urls = '["http://10.0.0.7:8000/v1", "http://10.0.0.8:8000/v1"]'
    config = resolve(
        tmp_path,
        "--launch.processes",
        '["orchestrator", "trainer"]',
        "--orchestrator.base-url",
        urls,
        "--orchestrator.inference-private-network",
        "true",
    )
    assert config.orchestrator.base_url == ["http://10.0.0.7:8000/v1", "http://10.0.0.8:8000/v1"]
    assert list(specs(config, tmp_path)) == ["orchestrator", "trainer"]


def test_preflight_checks_only_the_ports_of_this_nodes_processes(tmp_path: Path) -> None:
    common = ["--trainer.num-ranks", "2", "--launch.nodes", "2"]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = str(busy.getsockname()[1])
        with pytest.raises(ConfigError, match=r"inference\.port"):
            preflight(resolve(tmp_path, *common, "--inference.port", port))
        preflight(resolve(tmp_path, *common, "--inference.port", port, "--launch.node-rank", "1"))


def test_the_wrapped_rendezvous_store_listens_on_the_given_host_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous

    from prime_composer.launch.torchrun import bind_stores_to

    handler = dynamic_rendezvous.DynamicRendezvousHandler
    monkeypatch.setattr(c10d_rendezvous_backend, "TCPStore", c10d_rendezvous_backend.TCPStore)
    monkeypatch.setattr(handler, "_create_tcp_store_server", handler._create_tcp_store_server)
    bind_stores_to("127.0.0.1")
    # As torch's c10d backend calls it (a host name that also resolves to other interfaces).
    store = c10d_rendezvous_backend.TCPStore(socket.gethostname(), 0, is_master=True, multi_tenant=True)
    listening = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, check=True).stdout
    addresses = [
        line.split()[3] for line in listening.splitlines() if line.split()[3].endswith(f":{store.port}")
    ]
    assert addresses == [f"127.0.0.1:{store.port}"], addresses
    store.set("k", "v")
    assert store.get("k") == b"v"
    server = handler._create_tcp_store_server(None, "127.0.0.1", 0)  # type: ignore[arg-type]
    assert server.port != store.port

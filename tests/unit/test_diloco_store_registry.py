"""The DiLoCo ``Store`` registry: every ``diloco.store`` literal is registered, the shardcast loop
builds its store through the registry (never naming a concrete class), and a bad value is one
line naming the key and the known stores."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest

from prime_composer.config.diloco import DilocoConfig, DilocoStoreName, PeerConfig
from prime_composer.config.errors import ConfigError
from prime_composer.config.ports import free_port
from prime_composer.config.resolve import resolve_rl_config
from prime_composer.diloco.base import STORES, Store, build_store
from prime_composer.diloco.loop import make_store


def _config(**fields: object) -> DilocoConfig:
    peer = PeerConfig(cluster_id="dc-1", urls=[f"http://127.0.0.1:{free_port()}"])
    return DilocoConfig(enabled=True, port=free_port(), peers=[peer], secret_env="S", **fields)  # type: ignore[arg-type]


def test_every_store_literal_is_registered() -> None:
    for name in get_args(DilocoStoreName):
        STORES.get_or_load(name)
    assert set(STORES) == set(get_args(DilocoStoreName)) == set(STORES.modules)


def test_the_shardcast_store_is_built_from_the_registry(tmp_path: Path) -> None:
    from prime_composer.diloco.shardcast_store import ShardcastStore

    store = build_store(_config(store="shardcast"), tmp_path, b"secret")
    try:
        assert isinstance(store, ShardcastStore)
        assert store.available("dc-1", timeout_s=0.5) is None  # nobody serves dc-1: data, not a crash
    finally:
        store.close()


def test_the_loop_asks_the_registry_for_its_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[tuple[DilocoConfig, Path, bytes | None]] = []

    class Fake:
        def publish(self, kind: str, round_: int, data: bytes) -> None: ...
        def available(self, cluster: str, timeout_s: float) -> None: ...
        def fetch(self, *args: object, **kwargs: object) -> None: ...
        def close(self) -> None: ...

    def fake(cfg: DilocoConfig, work_dir: Path, secret: bytes | None) -> Store:
        built.append((cfg, work_dir, secret))
        return Fake()  # type: ignore[return-value]

    STORES.get_or_load("shardcast")
    monkeypatch.setitem(STORES._entries, "shardcast", fake)
    cfg = _config()
    store = make_store(cfg, tmp_path, b"k")
    assert isinstance(store, Fake) and built == [(cfg, tmp_path, b"k")]
    assert make_store(DilocoConfig(enabled=True), tmp_path, None) is None  # no peers: no store


def test_an_unknown_store_names_the_key_and_the_known_stores(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_rl_config(["--diloco.store", "s3", "--output-dir", str(tmp_path)])
    message = str(info.value)
    assert "diloco.store = 's3'" in message and "'shardcast'" in message and "\n" not in message, message
    with pytest.raises(ValueError, match=r"diloco\.store = 's3': choose one of \['shardcast'\]"):
        STORES.get_or_load("s3")


def test_a_store_with_the_torchft_backend_is_refused() -> None:
    with pytest.raises(ValueError, match=r'diloco\.store = "shardcast" is a store of backend = "shardcast"'):
        DilocoConfig(backend="torchft", quantization="none", store="shardcast")
    assert DilocoConfig(backend="torchft", quantization="none").store_name == "shardcast"

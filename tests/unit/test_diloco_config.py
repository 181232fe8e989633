"""``[diloco]`` validation: invalid combinations fail when the config is parsed (``--dry-run``)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from prime_composer.config.diloco import DilocoConfig

PEER = {"cluster_id": "dc-us", "urls": ["http://10.0.0.2:7701"]}


def test_defaults_are_diloco_paper_values() -> None:
    cfg = DilocoConfig()
    assert (cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov) == (0.7, 0.9, True)
    assert cfg.enabled is False and cfg.host == "127.0.0.1"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"sync_every": 50, "num_fragments": 4}, "not divisible"),
        ({"sync_every": 40, "num_fragments": 4, "fragment_sync_delay": 10}, "must be below"),
        ({"peers": [PEER]}, "secret_env"),
        ({"host": "0.0.0.0"}, "reachable from other machines"),
        ({"cluster_id": "dc-us", "peers": [PEER], "secret_env": "S"}, "must all differ"),
        ({"min_clusters": 2}, "min_clusters"),
        ({"block_size": 7}, "even"),
        ({"num_fragments": 8, "sync_every": 64, "keep_rounds": 8}, "keep_rounds"),
        ({"backend": "torchft", "quantization": "int4"}, "not available"),
        ({"cluster_id": "dc/eu"}, "cluster id"),
    ],
)
def test_invalid_combinations_fail_with_the_field_named(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        DilocoConfig(**fields)


def test_a_valid_multi_dc_config_orders_clusters() -> None:
    cfg = DilocoConfig(
        cluster_id="dc-eu",
        peers=[PEER],
        secret_env="S",
        private_network=True,  # plain http:// to 10.0.0.2
        sync_every=40,
        num_fragments=4,
        fragment_sync_delay=9,
    )
    assert cfg.cluster_ids == ["dc-eu", "dc-us"]
    assert cfg.steps_per_fragment == 10

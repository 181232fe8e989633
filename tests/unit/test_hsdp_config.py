"""``trainer.parallel`` (HSDP): the grid is checked against ``trainer.num_ranks`` and the nodes with
errors naming the keys, reaches the trainer's resolved config, and builds a ``(replicate, shard)``
mesh (a single process here: the mesh itself is exercised on 4 ranks in
``tests/integration/test_hsdp.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prime_composer.config.errors import ConfigError
from prime_composer.config.resolve import resolve_rl_config
from prime_composer.config.trainer import TrainerConfig
from prime_composer.launch.rl import write_resolved_configs

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.toml"


def resolve(tmp_path: Path, *extra: str):  # type: ignore[no-untyped-def]
    config, _ = resolve_rl_config(["@", str(QUICKSTART), "--output-dir", str(tmp_path), *extra])
    return config


def test_the_mesh_shape_follows_from_replicate_or_is_given_whole() -> None:
    assert TrainerConfig(num_ranks=4).mesh_shape == (1, 4)
    assert TrainerConfig.model_validate({"num_ranks": 4, "parallel": {"replicate": 2}}).mesh_shape == (2, 2)
    given = TrainerConfig.model_validate({"num_ranks": 8, "parallel": {"replicate": 2, "shard": 4}})
    assert given.mesh_shape == (2, 4)
    assert TrainerConfig.model_validate({"num_ranks": 4, "parallel": {"replicate": 4}}).mesh_shape == (4, 1)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--trainer.parallel.replicate", "3"],
            r"trainer.parallel.replicate = 3 does not divide trainer.num_ranks = 4",
        ),
        (
            ["--trainer.parallel.replicate", "2", "--trainer.parallel.shard", "4"],
            r"2 x 4 = 8, but trainer.num_ranks = 4: .* set shard = 2",
        ),
        (["--trainer.parallel.replicate", "0"], r"trainer.parallel.replicate"),
    ],
)
def test_a_grid_that_does_not_hold_every_rank_once_is_refused(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve(tmp_path, "--trainer.num-ranks", "4", *flags)


def test_across_nodes_a_copy_takes_part_of_one_node_or_whole_nodes(tmp_path: Path) -> None:
    nodes = ["--launch.nodes", "2", "--trainer.num-ranks", "8"]
    within = resolve(tmp_path, *nodes, "--trainer.parallel.replicate", "2")  # a copy per node
    assert within.trainer.mesh_shape == (2, 4)
    assert resolve(tmp_path, *nodes, "--trainer.parallel.replicate", "4").trainer.mesh_shape == (4, 2)
    whole = ["--launch.nodes", "4", "--trainer.num-ranks", "8", "--trainer.parallel.replicate", "2"]
    assert resolve(tmp_path, *whole).trainer.mesh_shape == (2, 4)  # two nodes per copy
    with pytest.raises(ConfigError, match=r"HSDP of 3 x 2 ranks on launch.nodes = 2 of 3 ranks each"):
        resolve(
            tmp_path, "--launch.nodes", "2", "--trainer.num-ranks", "6", "--trainer.parallel.replicate", "3"
        )


def test_the_grid_reaches_the_trainers_resolved_config(tmp_path: Path) -> None:
    config = resolve(tmp_path, "--trainer.num-ranks", "4", "--trainer.parallel.replicate", "2")
    paths = write_resolved_configs(config, tmp_path / "cfg")
    trainer = json.loads(Path(paths["trainer"]).read_text())
    assert trainer["parallel"] == {"replicate": 2, "shard": None}
    assert TrainerConfig.model_validate(trainer).mesh_shape == (2, 2)

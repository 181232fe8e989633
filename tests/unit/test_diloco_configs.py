"""The shipped DiLoCo configs resolve as whole ``rl`` configs (``test_shipped_configs.py`` parses
every file of ``configs/``), and the two quickstart data centers point at each other with the
settings every DC must share identical and the per-DC ones different."""

from __future__ import annotations

from pathlib import Path

from prime_composer.config.resolve import resolve_rl_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def resolve(name: str):
    return resolve_rl_config(["@", str(CONFIGS / name)])[0]


def test_the_two_quickstart_dcs_point_at_each_other() -> None:
    a, b = resolve("diloco-dc-a.toml"), resolve("diloco-dc-b.toml")
    assert a.diloco.enabled and a.diloco.secret_env == "DILOCO_SECRET"
    assert a.diloco.peers[0].urls == [f"http://127.0.0.1:{b.diloco.port}"]
    assert b.diloco.peers[0].urls == [f"http://127.0.0.1:{a.diloco.port}"]
    assert a.diloco.cluster_ids == b.diloco.cluster_ids
    # What differs per DC, so two DCs can share one machine.
    assert a.output_dir != b.output_dir and a.inference.port != b.inference.port
    # What must not differ: the outer loop and the training run itself.
    shared = ("run_id", "sync_every", "num_fragments", "fragment_sync_delay", "quantization", "outer")
    for key in shared:
        assert getattr(a.diloco, key) == getattr(b.diloco, key), key
    assert a.trainer.diloco == a.diloco  # rl hands the section to the trainer
    assert a.ckpt.parts == ("trainer", "orchestrator", "diloco")


def test_the_two_real_dc_example_needs_its_secret() -> None:
    eu = resolve("diloco-two-dc.toml")
    assert eu.diloco.host == "0.0.0.0" and eu.diloco.secret_env is not None

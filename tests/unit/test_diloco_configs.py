"""The shipped DiLoCo configs resolve as whole ``rl`` configs (``test_shipped_configs.py`` parses
every file of ``configs/``), and the two quickstart data centers point at each other with the
settings every DC must share identical and the per-DC ones different."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

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


def test_each_dc_draws_its_own_data_seed_unless_one_is_set() -> None:
    a, b = resolve("diloco-dc-a.toml"), resolve("diloco-dc-b.toml")
    # The documented rule, computed here: seed + the first 8 bytes of SHA-256(cluster_id), mod 2**63.
    for dc, cid in ((a, "dc-a"), (b, "dc-b")):
        offset = int(hashlib.sha256(cid.encode()).hexdigest()[:16], 16)
        assert dc.orchestrator.seed == (dc.seed + offset) % 2**63
        assert dc.trainer.seed == dc.seed  # the same initialisation in every DC
    assert a.orchestrator.seed != b.orchestrator.seed
    chosen = resolve_rl_config(["@", str(CONFIGS / "diloco-dc-b.toml"), "--diloco.data-seed", "7"])[0]
    assert chosen.orchestrator.seed == 7
    assert resolve("quickstart.toml").orchestrator.seed == resolve("quickstart.toml").seed


def test_a_dc_without_its_secret_fails_the_preflight(monkeypatch: pytest.MonkeyPatch) -> None:
    from prime_composer.config.errors import ConfigError
    from prime_composer.launch.preflight import preflight

    config = resolve("diloco-two-dc.toml")
    monkeypatch.delenv("DILOCO_SECRET", raising=False)
    with pytest.raises(ConfigError, match=r"diloco\.secret_env = 'DILOCO_SECRET'.*not set"):
        preflight(config)
    monkeypatch.setenv("DILOCO_SECRET", "s")
    try:
        preflight(config)
    except ConfigError as e:  # other checks of this machine may fail; the secret's must not
        assert "diloco" not in str(e), e


def test_the_recipe_as_two_dcs_shards_each_trainer_and_shares_the_outer_loop() -> None:
    eu, us = resolve("composer-diloco/dc-eu.toml"), resolve("composer-diloco/dc-us.toml")
    for dc in (eu, us):
        assert dc.diloco.enabled and dc.trainer.num_ranks == 6 and dc.trainer.diloco == dc.diloco
        assert len(dc.launch.gpus["trainer"]) == 6
    assert eu.diloco.model_dump(exclude={"cluster_id", "peers"}) == us.diloco.model_dump(
        exclude={"cluster_id", "peers"}
    )
    assert eu.diloco.cluster_ids == us.diloco.cluster_ids == ["dc-eu", "dc-us"]
    assert eu.orchestrator.seed != us.orchestrator.seed and eu.trainer.seed == us.trainer.seed


def test_the_two_quickstart_dcs_warm_up_on_the_same_data_with_the_same_settings(tmp_path: Path) -> None:
    """Each DC runs its own warm-up (``[warmup]`` is on in the quickstart) and DiLoCo needs both
    to start from the same weights: the warm-up's data are drawn with the run's seed, not the
    DC's data seed, and its ``sft`` settings are the same but for the folders. (That a warm-up
    with the same data and settings gives the same bits in another launch is
    ``tests/e2e/test_quickstart_launcher.py``'s.)"""
    from prime_composer.config.cli import load_file
    from prime_composer.config.orchestrator import OrchestratorConfig
    from prime_composer.launch import rl
    from prime_composer.orchestrator.sft_export import export_sft_data

    data, sft = {}, {}
    for name in "ab":
        out = tmp_path / name
        argv = [
            "@",
            str(CONFIGS / f"diloco-dc-{name}.toml"),
            "--output-dir",
            str(out),
            "--warmup.num-examples",
            "64",
        ]
        config = resolve_rl_config(argv)[0]
        specs, final = rl.warmup_specs(config, rl.write_resolved_configs(config))
        assert [s.name for s in specs] == ["sft-data", "sft"] and final == out / "sft" / "final"
        argv = specs[0].argv
        option = {k: argv[argv.index(k) + 1] for k in ("--config", "--num-examples", "--seed")}
        assert int(option["--seed"]) == config.seed != config.orchestrator.seed
        # What the sft-data process does with those arguments, here in-process.
        orchestrator = OrchestratorConfig.model_validate(
            load_file(Path(option["--config"]), origin="--config").values
        )
        orchestrator = orchestrator.model_copy(update={"seed": int(option["--seed"])})
        export_sft_data(orchestrator, out / "data.jsonl", int(option["--num-examples"]))
        data[name] = (out / "data.jsonl").read_text()
        sft[name] = (out / "configs" / "sft.json").read_text().replace(str(out), "<output_dir>")
    assert data["a"] == data["b"] and data["a"].count("\n") == 64
    assert sft["a"] == sft["b"]

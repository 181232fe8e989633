"""Several toy DC processes on 127.0.0.1 exchange through shardcast origins and agree bit for bit.

Each DC trains its own MLP on its own data (``prime_composer.diloco.toy``); after every round it
logs the SHA-256 of the new global fragment. Every DC must log the same digest for every round.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from prime_composer.config.diloco import DilocoConfig, TorchftConfig
from prime_composer.diloco.fragments import split_fragments
from prime_composer.diloco.toy import free_port, loopback_configs, make_model, read_log, spawn

SECRET_ENV = "DILOCO_TEST_SECRET"


def run_dcs(
    tmp_path: Path,
    num_dcs: int,
    steps: int,
    timeout_s: float = 300.0,  # start-up included: 3 torch processes take minutes on a loaded machine
    configs: list[DilocoConfig] | None = None,
    ranks: int | list[int] = 1,
    extra: list[list[str]] | None = None,
    **fields: object,
) -> dict[str, list]:
    """Run toy DCs (loopback shardcast configs unless ``configs``; ``ranks`` FSDP ranks each, or
    per DC; ``extra`` arguments per DC) to ``steps``; their logs."""
    if configs is None:
        configs = loopback_configs(num_dcs, SECRET_ENV, round_deadline_s=10.0, poll_interval_s=0.05, **fields)
    env = {SECRET_ENV: "test-secret", "PYTHONHASHSEED": "0"}
    # Training starts once every DC is up (START), so a slow start-up never leaves one out.
    start = ["--start-file", str(tmp_path / "START")]
    per_dc = ranks if isinstance(ranks, list) else [ranks] * len(configs)
    procs = [
        spawn(
            c,
            tmp_path,
            "--steps",
            str(steps),
            "--seed",
            str(i + 1),
            *start,
            *(extra[i] if extra else []),
            env=env,
            ranks=per_dc[i],
        )
        for i, c in enumerate(configs)
    ]
    try:
        deadline = time.monotonic() + timeout_s
        while not all(read_log(tmp_path / f"{c.cluster_id}.jsonl") for c in configs):
            assert time.monotonic() < deadline, "DCs did not start"
            assert all(p.poll() is None for p in procs), "a DC exited early: see its stderr.log"
            time.sleep(0.2)
        (tmp_path / "START").touch()
        while time.monotonic() < deadline:
            logs = {c.cluster_id: read_log(tmp_path / f"{c.cluster_id}.jsonl") for c in configs}
            if all(log and "done" in log[-1] for log in logs.values()):
                return logs
            assert all(p.poll() is None for p in procs), "a DC exited early: see its stderr.log"
            time.sleep(0.2)
        pytest.fail(f"DCs did not finish {steps} steps in {timeout_s} s")
    finally:
        (tmp_path / "STOP").touch()
        for p in procs:
            try:
                p.wait(timeout=10)
            except Exception:
                if per_dc[procs.index(p)] > 1:  # torchrun and its ranks share a process group of their own
                    os.killpg(p.pid, signal.SIGKILL)
                p.kill()
    raise AssertionError("unreachable")


def rounds(log: list[dict]) -> dict[int, dict]:
    return {r["round"]: r for r in log if "round" in r}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("num_dcs", "fields"),
    [
        (3, {"quantization": "int4", "num_fragments": 2, "sync_every": 8, "fragment_sync_delay": 2}),
        (2, {"quantization": "int8", "num_fragments": 1, "sync_every": 4, "error_feedback": True}),
    ],
    ids=["3dc-int4-streaming", "2dc-int8-ef"],
)
def test_every_dc_ends_every_round_with_identical_global_weights(
    tmp_path: Path, num_dcs: int, fields: dict[str, object]
) -> None:
    logs = run_dcs(tmp_path, num_dcs, steps=20, **fields)
    per_dc = [rounds(log) for log in logs.values()]
    assert len(per_dc[0]) >= 4
    for r, record in per_dc[0].items():
        assert record["members"] == sorted(logs), f"round {r}: every DC should contribute"
        assert {dc[r]["digest"] for dc in per_dc} == {record["digest"]}, f"round {r} digests differ"
    finals = {log[-1]["global_digest"] for log in logs.values()}
    assert len(finals) == 1
    assert all(log[-1]["rejected"] == {} for log in logs.values())


SHARDED_FIELDS: dict[str, object] = {
    "quantization": "none",
    "num_fragments": 2,
    "sync_every": 4,
    "fragment_sync_delay": 1,
}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sharded runs' reference: the same 2 DCs with one rank each (their work dirs)."""
    root = tmp_path_factory.mktemp("one-rank")
    run_dcs(root, 2, steps=9, timeout_s=300, **SHARDED_FIELDS)
    return root


@pytest.mark.slow
def test_sharded_dcs_agree_and_match_dcs_of_one_rank(tmp_path: Path, one_rank: Path) -> None:
    """2 DCs x 2 FSDP ranks (gloo): every round's global fragment is the same bits in both DCs,
    and the run ends where the same run with 1 rank per DC ends, to float tolerance (the ranks
    average half-batch gradients; one rank takes the full batch's)."""
    sharded = run_dcs(tmp_path / "two-ranks", 2, steps=9, timeout_s=300, ranks=2, **SHARDED_FIELDS)
    per_dc = [rounds(log) for log in sharded.values()]
    assert sorted(per_dc[0]) == sorted(per_dc[1]) == [0, 1, 2, 3]
    for r, record in per_dc[0].items():
        assert record["members"] == ["dc-0", "dc-1"], f"round {r}: both DCs should contribute"
        assert per_dc[1][r]["digest"] == record["digest"], f"round {r} digests differ"
    assert len({log[-1]["global_digest"] for log in sharded.values()}) == 1

    for dc in ("dc-0", "dc-1"):
        for name in ("theta.pt", "local.pt"):
            got = torch.load(tmp_path / "two-ranks" / dc / name)
            want = torch.load(one_rank / dc / name)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"{dc} {name}")
    # Round 3 (fragment 1) was applied at the last step with alpha 0: the gathered local fragment
    # is the global one, bit for bit, so the scatter wrote each rank's shard where it belongs.
    theta = torch.load(tmp_path / "two-ranks" / "dc-0" / "theta.pt")
    local = torch.load(tmp_path / "two-ranks" / "dc-0" / "local.pt")
    assert not torch.equal(theta, local)  # fragment 0 trained on after its round 2
    split = theta.numel() - split_fragments(make_model(16, 2), 2)[-1].numel  # the toy's default MLP
    assert torch.equal(theta[split:], local[split:])


@pytest.mark.slow
def test_a_dc_with_an_hsdp_trainer_joins_as_one_dc(tmp_path: Path, one_rank: Path) -> None:
    """dc-0 trains with HSDP (``--replicate 2``: 2 copies x 2 shards, 4 gloo ranks, the trainer's
    ``trainer.parallel.replicate`` mesh), dc-1 with one rank: both are members of every round with
    the same bits, dc-0's two copies end with the same shards (the new global fragments reached
    both copies, not only the leader's), and both DCs end where two DCs of one rank end (1e-5)."""
    logs = run_dcs(
        tmp_path, 2, steps=9, timeout_s=300, ranks=[4, 1], extra=[["--replicate", "2"], []], **SHARDED_FIELDS
    )
    per_dc = [rounds(log) for log in logs.values()]
    assert sorted(per_dc[0]) == sorted(per_dc[1]) == [0, 1, 2, 3]
    for r, record in per_dc[0].items():
        assert record["members"] == ["dc-0", "dc-1"], f"round {r}: both DCs should contribute"
        assert per_dc[1][r]["digest"] == record["digest"], f"round {r} digests differ"
    assert logs["dc-0"][-1]["replicas_agree"] is True
    for dc in ("dc-0", "dc-1"):
        for name in ("theta.pt", "local.pt"):
            got, want = torch.load(tmp_path / dc / name), torch.load(one_rank / dc / name)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"{dc} {name}")


def test_origin_requires_a_signed_request_except_on_health(tmp_path: Path) -> None:
    import httpx

    from prime_composer.diloco.shardcast_store import Origin
    from prime_composer.wire.auth import AUTH_HEADER, sign_request, transport_key

    origin = Origin(tmp_path, "127.0.0.1", 0, secret="s3", keep_versions=4, audience="dc-a")
    origin.publish("grad", 0, b"payload")
    base = f"http://127.0.0.1:{origin.port}"

    def signed(path: str) -> dict[str, str]:
        return {AUTH_HEADER: sign_request(transport_key(b"s3"), "GET", path, b"", "dc-a")}

    try:
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.get(f"{base}/distribution.txt").status_code == 401
        # The secret itself is not a credential: nothing reusable is accepted.
        assert (
            httpx.get(f"{base}/distribution.txt", headers={"Authorization": "Bearer s3"}).status_code == 401
        )
        ok = httpx.get(f"{base}/v1/shard_00001.bin", headers=signed("/v1/shard_00001.bin"))
        assert ok.status_code == 200 and ok.content == b"payload"
        assert httpx.get(f"{base}/v1/", headers=signed("/v1/")).status_code == 404
    finally:
        origin.close()


def _torchft_configs(lighthouse_port: int, **fields: object) -> list[DilocoConfig]:
    torchft = TorchftConfig(lighthouse=f"http://127.0.0.1:{lighthouse_port}", timeout_s=30)
    return [
        DilocoConfig(
            enabled=True,
            backend="torchft",
            quantization="none",
            cluster_id=f"dc-{i}",
            port=free_port(),
            torchft=torchft.model_copy(update={"store_port": free_port()}),
            **fields,
        )
        for i in range(2)
    ]


@pytest.mark.slow
def test_torchft_backend_agrees_and_matches_the_shardcast_outer_loop(tmp_path: Path) -> None:
    """Same two DCs, same data, no quantization: torchft's DiLoCo (its own fragment schedule,
    all-reduce and torch.optim.SGD) and ours end with the same global weights, bit for bit
    (0.5 * a + 0.5 * b is exactly (a + b) / 2 in floating point)."""
    import subprocess

    # tau = 0: torchft takes a fragment's pseudo-gradient tau steps *before* its sync point and we
    # take it at the sync point (and apply tau steps later); without overlap the two coincide.
    schedule = {"sync_every": 4, "num_fragments": 2, "fragment_sync_delay": 0, "fragment_update_alpha": 0.0}
    port = free_port()
    lighthouse = subprocess.Popen(
        [
            "torchft_lighthouse",
            "--bind",
            f"127.0.0.1:{port}",
            "--min_replicas",
            "2",
            "--join_timeout_ms",
            "5000",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        torchft_logs = run_dcs(tmp_path / "torchft", 2, steps=12, configs=_torchft_configs(port, **schedule))
    finally:
        lighthouse.kill()
        lighthouse.wait()
    per_dc = [rounds(log) for log in torchft_logs.values()]
    assert len(per_dc[0]) == 6 and per_dc[0].keys() == per_dc[1].keys()
    assert all(per_dc[0][r]["digest"] == per_dc[1][r]["digest"] for r in per_dc[0])
    ours = run_dcs(tmp_path / "shardcast", 2, steps=12, quantization="none", **schedule)
    assert len({log[-1]["global_digest"] for log in ours.values()}) == 1
    theirs_theta = torch.load(tmp_path / "torchft" / "dc-0" / "theta.pt")
    ours_theta = torch.load(tmp_path / "shardcast" / "dc-0" / "theta.pt")
    assert torch.equal(ours_theta, theirs_theta), (ours_theta - theirs_theta).abs().max()


assert os.environ.get(SECRET_ENV) is None  # the secret only reaches the DC processes

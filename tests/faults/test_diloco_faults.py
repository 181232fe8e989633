"""DiLoCo under faults: a DC killed mid-round, its restart, and hostile payloads.

- kill: the surviving DCs finish the round within the deadline and go on; the restarted DC
  downloads the agreed state, contributes again and ends with the others' weights, bit for bit;
- hostile peer: tampered, unsigned, replayed, foreign-run and forged-commit payloads served by a
  real origin are all rejected (never a member of a round), each counted under its reason; so are
  validly signed grads with a negative token count or NaN values, each downloaded once.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from prime_composer.config.diloco import DilocoConfig
from prime_composer.diloco.exchange import Exchange
from prime_composer.diloco.payload import encode, grad_body, tensor_digest
from prime_composer.diloco.quantize import quantize
from prime_composer.diloco.shardcast_store import Origin, ShardcastStore
from prime_composer.diloco.toy import free_port, loopback_configs, read_log, spawn

SECRET_ENV = "DILOCO_TEST_SECRET"
ENV = {SECRET_ENV: "fault-secret"}


def _wait(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    until = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > until:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", [2, 0], ids=["follower", "coordinator"])
def test_killed_dc_is_left_out_then_rejoins_with_identical_weights(tmp_path: Path, victim: int) -> None:
    """dc-0 sorts first, so it coordinates; killing it makes dc-1 commit after the failover wait."""
    deadline_s = 4.0
    configs = loopback_configs(3, SECRET_ENV, sync_every=4, quantization="int4", round_deadline_s=deadline_s)
    # Many steps: the test ends the run (STOP) once the restarted DC has contributed a few rounds,
    # however long its start-up takes on a loaded machine.
    common = ["--steps", "2000", "--step-sleep-s", "0.2"]
    procs = {
        c.cluster_id: spawn(
            c, tmp_path, *common, "--seed", str(i), *(["--die-at-round", "2"] if i == victim else []), env=ENV
        )
        for i, c in enumerate(configs)
    }
    log = {c.cluster_id: tmp_path / f"{c.cluster_id}.jsonl" for c in configs}
    dead = f"dc-{victim}"
    survivors = [c for c in log if c != dead]
    # A dead follower costs nothing (its origin refuses connections); a dead coordinator costs
    # the failover wait: the next candidate commits after 2 deadlines.
    limit_s = (2 * deadline_s if victim == 0 else 0.0) + 2.0
    try:
        _wait(lambda: procs[dead].poll() is not None, 120, f"{dead} to die at round 2")
        survivors_round_2 = lambda: all(  # noqa: E731
            any(r.get("round") == 2 for r in read_log(log[c])) for c in survivors
        )
        _wait(survivors_round_2, 4 * deadline_s, "the survivors to finish round 2")
        for c in survivors:
            record = next(r for r in read_log(log[c]) if r.get("round") == 2)
            assert record["round_s"] < limit_s, f"{c} took {record['round_s']} s for round 2"
        # Restart it from nothing (no checkpoint): it must catch up from the committers' states.
        procs[dead] = spawn(configs[victim], tmp_path, *common, "--seed", str(victim), env=ENV)

        def contributed_again() -> bool:
            entries = read_log(log[dead])
            restart = max(i for i, e in enumerate(entries) if e.get("start"))
            return sum(dead in e.get("members", ()) for e in entries[restart:]) >= 3

        _wait(contributed_again, 240, f"the restarted {dead} to contribute 3 rounds")
        (tmp_path / "STOP").touch()
        _wait(lambda: all(read_log(p) and "done" in read_log(p)[-1] for p in log.values()), 60, "all DCs")
    finally:
        (tmp_path / "STOP").touch()
        for p in procs.values():
            try:
                p.wait(timeout=15)
            except Exception:
                p.kill()

    logs = {c: read_log(p) for c, p in log.items()}
    by_round = {c: {r["round"]: r for r in entries if "round" in r} for c, entries in logs.items()}
    # Every round any two DCs both applied ended with the same global fragment.
    for r in by_round["dc-1"]:
        digests = {by_round[c][r]["digest"] for c in by_round if r in by_round[c]}
        assert len(digests) == 1, f"round {r}: digests differ {digests}"
    # Left out of the rounds while it was down, a member again after it came back.
    assert dead not in by_round["dc-1"][3]["members"]
    restart = max(i for i, e in enumerate(logs[dead]) if e.get("start"))
    assert logs[dead][restart]["num_updates"] > 0, "the restarted DC should start from the agreed round"
    rejoined = [e for e in logs[dead][restart:] if "round" in e]
    shared = [e["round"] for e in rejoined if all(e["round"] in by_round[c] for c in by_round)]
    assert len(shared) >= 3, "the restarted DC should apply rounds together with the survivors"


def _grad_payload(
    cfg: DilocoConfig, exchange: Exchange, round_: int, theta: torch.Tensor, **overrides: object
) -> dict:
    fields, body = grad_body(
        quantize(torch.randn(theta.numel()), cfg.quantization, cfg.block_size), cfg.compression
    )
    header = exchange.header("grad", round_, 0, num_tokens=5, base_digest=tensor_digest(theta), **fields)
    return {"header": header | overrides, "body": body}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_hostile_payloads_are_all_rejected(tmp_path: Path) -> None:
    honest_port, evil_port = free_port(), free_port()
    secret = b"the-secret"
    cfg = DilocoConfig(
        cluster_id="dc-b",
        port=honest_port,
        peers=[{"cluster_id": "dc-a", "urls": [f"http://127.0.0.1:{evil_port}"]}],  # type: ignore[list-item]
        secret_env=SECRET_ENV,
        quantization="int4",
        round_deadline_s=1.0,
        poll_interval_s=0.05,
    )
    theta, momentum = torch.zeros(64), torch.zeros(64)
    store = ShardcastStore(
        tmp_path / "b",
        "127.0.0.1",
        honest_port,
        {"dc-a": [f"http://127.0.0.1:{evil_port}"]},
        secret.decode(),
        cfg.keep_rounds,
        cfg.poll_interval_s,
    )
    evil = Origin(tmp_path / "a", "127.0.0.1", evil_port, secret.decode(), keep_versions=30)
    exchange = Exchange(cfg, store, secret, ["layout"])
    evil_view = Exchange(cfg.model_copy(update={"cluster_id": "dc-a", "peers": []}), None, secret, ["layout"])
    own = _grad_payload(cfg, exchange, 0, theta)
    try:
        valid_round_0 = encode(**_grad_payload(cfg, evil_view, 0, theta), secret=secret)
        tampered = bytearray(encode(**_grad_payload(cfg, evil_view, 1, theta), secret=secret))
        tampered[len(tampered) // 2] ^= 0xFF
        cases = {
            1: (bytes(tampered), "bad_signature"),
            2: (encode(**_grad_payload(cfg, evil_view, 2, theta), secret=None), "unsigned"),
            3: (valid_round_0, "replayed"),  # an old, validly signed payload served as round 3
            4: (
                encode(**_grad_payload(cfg, evil_view, 4, theta, run_id="other"), secret=secret),
                "wrong_run_id",
            ),
            5: (encode(**_grad_payload(cfg, evil_view, 5, theta), secret=b"guessed"), "bad_signature"),
        }
        for round_, (data, reason) in cases.items():
            evil.publish("grad", round_, data)
            before = exchange.rejected[reason]
            mine = encode(**(own | {"header": own["header"] | {"round": round_}}), secret=secret)
            # dc-a sorts first: it is the coordinator; it never commits, so dc-b takes over.
            result = exchange.run_round(round_, 0, mine, theta, momentum, ["dc-a", "dc-b"])
            assert result.status == "applied" and result.members == ["dc-b"], (round_, reason)
            assert exchange.rejected[reason] > before, (round_, reason, dict(exchange.rejected))
        # A forged commit from the coordinator (unsigned) naming the attacker alone is rejected too.
        forged = evil_view.header(
            "commit",
            6,
            0,
            base_digest=tensor_digest(theta),
            members=[["dc-a", "x", 1]],
            next_candidates=["dc-a"],
        )
        evil.publish("commit", 6, encode(forged, b"", secret=None))
        mine = encode(**(own | {"header": own["header"] | {"round": 6}}), secret=secret)
        result = exchange.run_round(6, 0, mine, theta, momentum, ["dc-a", "dc-b"])
        assert result.members == ["dc-b"] and exchange.rejected["unsigned"] >= 2
        assert set(exchange.rejected) == {"bad_signature", "unsigned", "replayed", "wrong_run_id"}
    finally:
        store.close()
        evil.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchft_backend_survives_a_kill_and_heals_the_restarted_dc(tmp_path: Path) -> None:
    """The torchft version of the kill test: the survivor goes on alone after the heartbeat
    timeout, the restarted DC heals from it (torchft's HTTP checkpoint transport) and both end
    every later round with the same global weights."""
    import subprocess

    from prime_composer.config.diloco import TorchftConfig

    port = free_port()
    lighthouse = subprocess.Popen(
        [
            "torchft_lighthouse",
            "--bind",
            f"127.0.0.1:{port}",
            "--min_replicas",
            "1",
            "--join_timeout_ms",
            "3000",
            "--heartbeat_timeout_ms",
            "2000",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    torchft = TorchftConfig(lighthouse=f"http://127.0.0.1:{port}", timeout_s=10)
    configs = [
        DilocoConfig(
            enabled=True,
            backend="torchft",
            quantization="none",
            cluster_id=f"dc-{i}",
            port=free_port(),
            sync_every=4,
            torchft=torchft.model_copy(update={"store_port": free_port()}),
        )
        for i in range(2)
    ]
    common = ["--steps", "2000", "--step-sleep-s", "0.15", "--start-file", str(tmp_path / "START")]
    procs = {
        c.cluster_id: spawn(c, tmp_path, *common, "--seed", str(i), *(["--die-at-step", "10"] if i else []))
        for i, c in enumerate(configs)
    }
    log = {c.cluster_id: tmp_path / f"{c.cluster_id}.jsonl" for c in configs}
    try:
        # Both managers heartbeat before either trains, so the first quorum holds both.
        _wait(lambda: all(read_log(p) for p in log.values()), 120, "both DCs to start")
        (tmp_path / "START").touch()
        _wait(lambda: procs["dc-1"].poll() is not None, 120, "dc-1 to die")
        procs["dc-1"] = spawn(configs[1], tmp_path, *common, "--seed", "1")

        def healed_rounds() -> int:
            entries = read_log(log["dc-1"])
            restart = max(i for i, e in enumerate(entries) if e.get("start"))
            return sum("round" in e for e in entries[restart:])

        _wait(lambda: healed_rounds() >= 3, 240, "the restarted dc-1 to sync 3 rounds")
        (tmp_path / "STOP").touch()
        _wait(lambda: all(read_log(p) and "done" in read_log(p)[-1] for p in log.values()), 60, "both DCs")
    finally:
        (tmp_path / "STOP").touch()
        for p in procs.values():
            try:
                p.wait(timeout=15)
            except Exception:
                p.kill()
        lighthouse.kill()
        lighthouse.wait()
    logs = {c: read_log(p) for c, p in log.items()}
    by_round = {c: {r["round"]: r for r in entries if "round" in r} for c, entries in logs.items()}
    restart = max(i for i, e in enumerate(logs["dc-1"]) if e.get("start"))
    after = {e["round"]: e for e in logs["dc-1"][restart:] if "round" in e}
    assert after, "the restarted DC never synced"
    assert min(after) > 3, "the restarted DC should join at the survivor's step, not from scratch"
    shared = [r for r in after if r in by_round["dc-0"]]
    assert shared, "no round both DCs applied after the restart"
    for r in shared:
        assert after[r]["digest"] == by_round["dc-0"][r]["digest"], f"round {r} differs after healing"
    assert (
        by_round["dc-0"][0]["members"] == 2 and by_round["dc-0"][0]["digest"] == by_round["dc-1"][0]["digest"]
    )
    assert any(by_round["dc-0"][r]["members"] == 1 for r in by_round["dc-0"]), "dc-0 never went on alone"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_hostile_contributions_over_a_real_origin_are_fetched_once_and_leave_the_weights(
    tmp_path: Path,
) -> None:
    """A key holder's validly signed grads (a negative token count, NaN with quantization "none")
    served by a real origin: each round applies dc-b's contribution alone (theta - lr (1 + mu) g,
    by hand), and each bad payload is downloaded once per round, with the fragment's size cap."""
    honest_port, evil_port = free_port(), free_port()
    secret = b"the-secret"
    cfg = DilocoConfig(
        cluster_id="dc-b",
        port=honest_port,
        peers=[{"cluster_id": "dc-a", "urls": [f"http://127.0.0.1:{evil_port}"]}],  # type: ignore[list-item]
        secret_env=SECRET_ENV,
        quantization="none",
        round_deadline_s=1.0,
        poll_interval_s=0.05,
    )
    theta, momentum = torch.linspace(-1, 1, 64), torch.zeros(64)
    store = ShardcastStore(
        tmp_path / "b",
        "127.0.0.1",
        honest_port,
        {"dc-a": [f"http://127.0.0.1:{evil_port}"]},
        secret.decode(),
        cfg.keep_rounds,
        cfg.poll_interval_s,
    )
    fetched: list[tuple[str, int, int | None]] = []
    fetch = store.fetch

    def counted(cluster, kind, round_, timeout_s, max_bytes=None):  # type: ignore[no-untyped-def]
        fetched.append((kind, round_, max_bytes))
        return fetch(cluster, kind, round_, timeout_s, max_bytes=max_bytes)

    store.fetch = counted  # type: ignore[method-assign]
    evil = Origin(tmp_path / "a", "127.0.0.1", evil_port, secret.decode(), keep_versions=30)
    exchange = Exchange(cfg, store, secret, ["layout"])
    evil_view = Exchange(cfg.model_copy(update={"cluster_id": "dc-a", "peers": []}), None, secret, ["layout"])
    g = torch.full((64,), 0.25)
    nan = torch.full((64,), math.nan)

    def grad(view: Exchange, round_: int, values: torch.Tensor, **overrides: object) -> bytes:
        fields, body = grad_body(quantize(values, "none", cfg.block_size), cfg.compression)
        header = view.header("grad", round_, 0, num_tokens=100, base_digest=tensor_digest(theta), **fields)
        return encode(header | overrides, body, secret)

    cases = {
        1: (grad(evil_view, 1, g, num_tokens=-99), "bad_tokens"),
        2: (grad(evil_view, 2, nan), "non_finite"),
    }
    try:
        for round_, (data, reason) in cases.items():
            evil.publish("grad", round_, data)
            result = exchange.run_round(
                round_, 0, grad(exchange, round_, g), theta, momentum, ["dc-a", "dc-b"]
            )
            assert result.status == "applied" and result.members == ["dc-b"], (round_, reason)
            # lr 0.7, momentum 0.9, Nesterov from zero momentum: theta - 0.7 * 1.9 * 0.25.
            assert result.theta is not None
            torch.testing.assert_close(result.theta, theta - 0.3325, rtol=0, atol=1e-6)
            assert exchange.rejected[reason] == 1, (reason, dict(exchange.rejected))
            grads = [f for f in fetched if f[:2] == ("grad", round_)]
            assert len(grads) == 1 and grads[0][2] == exchange.max_bytes("grad", 64), grads
    finally:
        store.close()
        evil.close()

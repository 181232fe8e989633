"""The last round of a run: the coordinator commits and its run ends at once; its origin stays up
until its peer has downloaded the commit (and its grad), so the peer applies that commit well
inside the commit deadline instead of waiting it out and committing the round itself. The linger
is bounded: a peer that is gone, or that never fetches, does not hold a finished run."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from prime_composer.config.ports import free_port
from prime_composer.diloco.loop import ShardcastOuterLoop
from prime_composer.diloco.shardcast_store import ShardcastStore
from prime_composer.diloco.toy import loopback_configs, make_model

SECRET = b"last-round-secret"
DEADLINE_S = 8.0
"""The peer (candidate 1) would fail over after 2 x this without the commit."""


def _run_dc(cfg: Any, model: torch.nn.Module, work: Path, out: dict[str, Any], delay_s: float) -> None:
    outer = ShardcastOuterLoop(cfg, model, None, work)  # the loop does not use the optimizer
    time.sleep(delay_s)
    g = torch.Generator().manual_seed(ord(cfg.cluster_id[-1]))
    with torch.no_grad():  # one "inner step" of this DC (an optimizer costs seconds to import)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g), alpha=0.01)
    t0 = time.monotonic()
    outer.after_inner_step(0, 8, skipped=False)  # sync_every 1, no delay: the round runs here
    outer.finish()
    out[f"{cfg.cluster_id}/round_s"] = time.monotonic() - t0
    t1 = time.monotonic()
    outer.close()  # the run ends right after its last commit
    out[f"{cfg.cluster_id}/close_s"] = time.monotonic() - t1
    out[cfg.cluster_id] = outer.last_result
    out[f"{cfg.cluster_id}/digest"] = outer.global_digest()


@pytest.mark.slow
def test_the_peer_gets_the_last_commit_of_a_coordinator_whose_run_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LAST_ROUND_SECRET", SECRET.decode())
    fields = dict(
        sync_every=1,
        num_fragments=1,
        round_deadline_s=DEADLINE_S,
        quantization="none",
        poll_interval_s=0.05,
    )
    a, b = loopback_configs(2, "LAST_ROUND_SECRET", **fields)
    # The peer publishes first and looks for the commit before there is one; it polls slowly, so
    # the coordinator (0.5 s later) commits and its run ends before the peer looks again.
    b = b.model_copy(update={"poll_interval_s": 2.0})
    out: dict[str, Any] = {}
    threads = [
        # The models are built here: torch's global seed is not per thread.
        threading.Thread(
            target=_run_dc, args=(cfg, make_model(4, 1), tmp_path / cfg.cluster_id, out, delay_s)
        )
        for cfg, delay_s in ((a, 0.5), (b, 0.0))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=6 * DEADLINE_S)
    assert not any(t.is_alive() for t in threads)
    ra, rb = out["dc-0"], out["dc-1"]
    assert ra.committer == "dc-0" and ra.members == ["dc-0", "dc-1"]
    # The peer applied the coordinator's commit, not its own failover commit after 2 x deadline.
    assert rb.status == "applied" and rb.committer == "dc-0" and rb.members == ["dc-0", "dc-1"], rb
    assert out["dc-1/round_s"] < DEADLINE_S, out
    assert out["dc-0/digest"] == out["dc-1/digest"]
    assert torch.equal(ra.theta, rb.theta)
    # The coordinator waited for the peer's fetch, not for the linger bound.
    assert out["dc-0/close_s"] < DEADLINE_S, out


def _soon(condition: Any, timeout_s: float = 5.0) -> bool:
    """``condition()`` within ``timeout_s`` (the origin records a download after sending it, so
    just after the client has the bytes)."""
    until = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= until:
            return False
        time.sleep(0.01)
    return True


def _pair(tmp_path: Path) -> tuple[ShardcastStore, ShardcastStore]:
    """Two stores that reach each other's origin on 127.0.0.1."""
    ports = {"dc-a": free_port(), "dc-b": free_port()}
    a, b = (
        ShardcastStore(
            tmp_path / me,
            "127.0.0.1",
            ports[me],
            {peer: [f"http://127.0.0.1:{ports[peer]}"]},
            SECRET,
            4,
            0.05,
            cluster_id=me,
        )
        for me, peer in (("dc-a", "dc-b"), ("dc-b", "dc-a"))
    )
    return a, b


def test_the_origin_records_who_fetched_every_shard_of_a_version(tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    try:
        a.publish("commit", 3, b"x" * 100)
        assert not a.origin.seen("dc-b") and not a.origin.fetched("dc-b", "v11")
        assert b.available("dc-a", 2.0) == {("commit", 3)}
        assert _soon(lambda: a.origin.seen("dc-b"))
        assert not a.origin.fetched("dc-b", "v11")  # listed, not fetched
        assert b.fetch("dc-a", "commit", 3, 5.0) == b"x" * 100
        assert _soon(lambda: a.origin.fetched("dc-b", "v11")) and not a.origin.fetched("dc-c", "v11")
        a.publish("commit", 3, b"y" * 100)  # a version published again must be fetched again
        assert not a.origin.fetched("dc-b", "v11")
    finally:
        a.close()
        b.close()


@pytest.mark.slow
def test_the_linger_ends_when_the_peer_is_gone_and_is_bounded_when_it_never_fetches(
    tmp_path: Path,
) -> None:
    a, b = _pair(tmp_path)
    try:
        a.publish("commit", 0, b"c" * 10)
        assert b.available("dc-a", 2.0) is not None  # b has fetched from a before: it is waited for
        assert _soon(lambda: a.origin.seen("dc-b"))
        t0 = time.monotonic()
        assert a.linger({"dc-b": [("commit", 0)]}, 1.5) == ["dc-b"]  # up, never fetches: bounded
        assert 1.4 < time.monotonic() - t0 < 4.0
        b.close()  # b gone: not waited for beyond a probe
        t0 = time.monotonic()
        assert a.linger({"dc-b": [("commit", 0)]}, 30.0) == []
        assert time.monotonic() - t0 < 5.0
        # A peer that never fetched from this origin (it reaches it through the relay) is not
        # waited for.
        t0 = time.monotonic()
        assert a.linger({"dc-c": [("commit", 0)]}, 30.0) == []
        assert time.monotonic() - t0 < 0.5
    finally:
        a.close()
        b.close()

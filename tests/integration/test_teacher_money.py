"""Teacher spend against a provider that keeps its own bill, and calls that cannot run away.

The fake teachers (``teacher.fakes``) are real HTTP servers on 127.0.0.1 that append what they
charge to a bill file, as a provider would; the tests compare that bill with the service's ledger
and its caps. Bounded calls: a teacher that trickles its answer a byte at a time and one that sends
20 MB are cut off by the attempt's wall clock and the reply-size cap while being read.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from test_teacher_replay import PYTEST, coding_trace, make_config, replay

from prime_composer.config.client import RetryConfig
from prime_composer.inference.local import running_app
from prime_composer.teacher.budget import Budget
from prime_composer.teacher.fakes import fake_teacher_app, fixed

PRICES = (3.0, 15.0)  # dollars per million input, output tokens (make_config's prices)


def billed(path: Path) -> float:
    return sum(json.loads(line)["usd"] for line in path.read_text().splitlines()) if path.exists() else 0.0


def paid(ledger: list[dict]) -> float:
    return sum(r["dollars"] for r in ledger)


@pytest.mark.slow
def test_refused_steps_wait_and_the_run_cap_is_spent_to_within_a_call(tmp_path):
    """128 steps in flight against a cap of a quarter of what every step would cost: steps wait
    for money instead of giving up, at least 90% of the cap is spent, and neither the ledger nor the
    provider's bill ever passes it."""
    traces = [coding_trace(f"t{i}", task=f"Make the tests in calc{i}/ pass.") for i in range(50)]
    uncapped_bill, capped_bill = tmp_path / "uncapped.bill", tmp_path / "capped.bill"

    def run(bill: Path, out: Path, cap: float | None):
        app = fake_teacher_app(fixed(PYTEST), fault="slow", delay_s=0.05, bill=bill, prices=PRICES)
        with running_app(app) as url:
            cfg = make_config(out, {"a": f"{url}/v1"}, max_concurrent_steps=128)
            cfg.pool[0].max_concurrency = 64
            cfg.pool[0].max_tokens = 64
            cfg.pool[0].retry = RetryConfig(timeout_s=120.0, max_retries=0)  # no attempt cut short
            cfg.budget.per_run_usd = cap
            cfg.budget.reply_samples = 8
            return cfg, replay(cfg, traces)

    _, uncapped = run(uncapped_bill, tmp_path / "uncapped", None)
    everything = billed(uncapped_bill)
    assert len(uncapped.ledger()) == 200 and paid(uncapped.ledger()) == pytest.approx(everything)
    cap = 0.25 * everything
    _, store = run(capped_bill, tmp_path / "capped", cap)
    ledger = store.ledger()
    spent = paid(ledger)
    outcomes = [r["outcome"] for r in ledger]
    calls_ok, refused = outcomes.count("ok"), outcomes.count("budget")
    print(
        f"cap ${cap:.6f} (25% of ${everything:.6f}): spent ${spent:.6f} = {spent / cap:.3f} of the cap, "
        f"provider billed ${billed(capped_bill):.6f}; {calls_ok} calls, {refused} steps refused"
    )
    assert billed(capped_bill) == pytest.approx(spent, rel=1e-9)  # nothing billed goes unrecorded
    assert spent <= cap and billed(capped_bill) <= cap * (1 + 1e-12)
    assert billed(capped_bill) >= 0.9 * cap
    # Every step was either labeled or refused once, at the end, when nothing was in flight.
    assert calls_ok + refused == 200 and store.stats()["steps"].get("budget", 0) == refused
    assert store.reservations() == []


def test_a_reservation_shrinks_to_the_realistic_bound_near_the_cap(tmp_path):
    """Hand-built: a teacher whose replies were 10..29 tokens, a call whose full worst case does
    not fit the money left is sent with the max_tokens the money covers, down to 1.25 x its 99th
    percentile reply (29 -> 37 tokens), and refused below that."""
    cfg = make_config(tmp_path, {"a": "http://127.0.0.1:9/v1"})
    endpoint = cfg.pool[0]  # $3 / $15 per million tokens, max_tokens 512
    budget = Budget(cfg.budget.model_copy(update={"per_trace_usd": None, "per_run_usd": 0.01}))
    # No data yet: only a call at its full max_tokens may go: 1000 * 3e-6 + 512 * 15e-6 = 0.01068.
    assert budget.reserve_call("t", endpoint, 1000) is None
    for n in range(10, 30):
        budget.observe_reply("a", n)
    assert budget.reply_bound(endpoint) == 37  # ceil(1.25 * 29)
    r = budget.reserve_call("t", endpoint, 1000)
    # Room for (0.01 - 0.003) / 15e-6 = 466.67 output tokens: 466.
    assert r is not None and r.max_tokens == 466 and r.amount == pytest.approx(0.003 + 466 * 15e-6)
    # Left: 0.01 - 0.00999 = 1e-5 dollars, not even the prompt of a second call.
    assert budget.reserve_call("t", endpoint, 1000) is None
    budget.settle(r, 0.009)  # it cost 0.009: 0.001 left = 1000 prompt tokens and ... 0 output tokens
    assert budget.reserve_call("t", endpoint, 1000) is None
    # A shorter prompt: 0.0003 for it leaves room for 46 output tokens, at least the bound of 37.
    small = budget.reserve_call("t", endpoint, 100)
    assert small is not None and small.max_tokens == 46


# ------------------------------------------------------------------------------- bounded calls


def store_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "teacher").iterdir())


def one_call(tmp_path: Path, app, **endpoint) -> tuple[list[dict], float]:
    with running_app(app) as url:
        cfg = make_config(tmp_path, {"a": f"{url}/v1"})
        for k, v in endpoint.items():
            setattr(cfg.pool[0], k, v)
        started = time.monotonic()
        store = replay(cfg, [coding_trace("t1")])
        elapsed = time.monotonic() - started
    rows = store.ledger()
    assert store.reservations() == [] and store.stats()["calls"] == {rows[0]["outcome"]: 4}
    return rows, elapsed


def test_a_trickling_teacher_is_cut_off_by_the_attempt_wall_clock(tmp_path):
    """Each read of the trickle waits 0.2 s (far under any read timeout), the whole answer would
    take ~14 s: a 1 s attempt limit cuts every attempt at 1 s, counted as ``timeout`` and charged
    its worst case (the provider billed it)."""
    app = fake_teacher_app(fixed(PYTEST), fault="trickle", delay_s=0.2, bill=tmp_path / "bill", prices=PRICES)
    retry = RetryConfig(timeout_s=1.0, max_retries=1, backoff_s=0.0, max_backoff_s=0.0)
    rows, elapsed = one_call(tmp_path, app, retry=retry, max_concurrency=4)
    latencies = [r["latency_s"] for r in rows]
    print(f"4 steps x 2 attempts of a trickling teacher, 1 s each: {elapsed:.2f} s; latencies {latencies}")
    assert all(r["outcome"] == "timeout" and r["attempts"] == 2 for r in rows)
    assert all(2.0 <= t < 4.0 for t in latencies)  # two attempts of 1 s, not the ~16 s of the trickle
    assert len(app.state.requests) == 8
    assert 0 < billed(tmp_path / "bill") <= paid(rows) * (1 + 1e-9)


def test_the_step_deadline_cuts_every_teacher_of_a_step(tmp_path):
    """With attempts of 10 s but a step limit of 1.5 s, the trickle is cut at the step's deadline
    (``step_deadline``), and the retry is not started past it."""
    app = fake_teacher_app(fixed(PYTEST), fault="trickle", delay_s=0.2)
    retry = RetryConfig(timeout_s=10.0, max_retries=3, backoff_s=0.0, max_backoff_s=0.0)
    with running_app(app) as url:
        cfg = make_config(tmp_path, {"a": f"{url}/v1"}, step_timeout_s=1.5)
        cfg.pool[0].retry = retry
        store = replay(cfg, [coding_trace("t1")])
    rows = store.ledger()
    assert {r["outcome"] for r in rows} == {"step_deadline"} and len(rows) == 4
    assert all(1.0 <= r["latency_s"] < 3.0 and r["attempts"] == 1 for r in rows)


def test_a_huge_reply_is_cut_off_while_being_read(tmp_path):
    """A 20 MB answer against a 64 KiB cap: the read stops just past the cap (the server could
    push only what the socket buffers hold), nothing is cached, the call is ``too_large`` and
    charged its worst case."""
    app = fake_teacher_app(fixed(PYTEST), fault="huge", huge_bytes=20_000_000)
    rows, _ = one_call(tmp_path, app, max_reply_bytes=65536, retry=RetryConfig(max_retries=0))
    read = [int(r["error"].rsplit("(", 1)[1].split()[0]) for r in rows]
    print(f"huge reply: {read} bytes read of 20 MB each before the cut")
    assert all(r["outcome"] == "too_large" and "max_reply_bytes = 65536" in r["error"] for r in rows)
    assert all(65536 < n <= 65536 + 2**20 for n in read)  # one chunk past the cap at most
    assert store_bytes(tmp_path) < 2**20  # nothing of it was stored
    assert all(r["dollars"] > 0 for r in rows)

"""The replica pool: least in flight, step gating, a replica taken out and brought back, the relay
failing over, and weight updates sent to every replica."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from prime_composer.config.orchestrator import ReplicasConfig
from prime_composer.orchestrator.policy import PolicySync, WeightSyncError
from prime_composer.orchestrator.replicas import ReplicaPool, ReplicaRouter


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeServer:
    """Answers ``/health`` (with its weights step), ``/update_weights`` and any other POST with its
    name; ``status`` sets the answer of POSTs."""

    def __init__(self, name: str, status: int = 200) -> None:
        self.name = name
        self.status = status
        self.step: int | None = None
        self.calls: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                fake.calls.append(self.path)
                self._answer(200, {"status": "ok", "weights": {"path": None, "step": fake.step}})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                fake.calls.append(self.path)
                if fake.status == 200 and self.path == "/update_weights":
                    fake.step = int(Path(body["path"]).name.removeprefix("step_"))
                self._answer(fake.status, {"server": fake.name, "auth": self.headers.get("Authorization")})

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers() -> Iterator[list[FakeServer]]:
    fakes = [FakeServer("a"), FakeServer("b")]
    yield fakes
    for fake in fakes:
        fake.close()


def refused_url() -> str:
    """A loopback URL nothing listens on (a free port)."""
    from prime_composer.config.ports import free_port

    return f"http://127.0.0.1:{free_port()}/v1"


def test_calls_go_to_the_replica_with_fewest_in_flight() -> None:
    pool = ReplicaPool(["http://h:1/v1", "http://h:2/v1", "http://h:3/v1"])
    held = [pool.acquire() for _ in range(4)]
    # One each, then a tie on in-flight and calls served: list order.
    assert [r.index for r in held if r is not None] == [0, 1, 2, 0]
    pool.release(held[1])  # type: ignore[arg-type]
    # In flight now 2, 0, 1: the idle replica 1 is next, then 1 and 2 tie on one call in flight and
    # 2 has served fewer calls (1 against 2).
    assert [pool.acquire().index for _ in range(2)] == [1, 2]  # type: ignore[union-attr]


def test_only_replicas_on_the_current_step_take_calls() -> None:
    pool = ReplicaPool(["http://h:1/v1", "http://h:2/v1"])
    pool.mark_loaded(pool.replicas[1], 1)  # replica 1 runs step 1, replica 0 still step 0
    assert pool.step == 1
    assert {pool.acquire().index for _ in range(3)} == {1}  # type: ignore[union-attr]
    pool.mark_loaded(pool.replicas[0], 1)
    assert pool.acquire().index == 0  # type: ignore[union-attr]  # the idle one, now on step 1


def test_a_failing_replica_is_taken_out_and_brought_back(servers: list[FakeServer]) -> None:
    clock = FakeClock()
    config = ReplicasConfig(max_failures=2, retry_s=10.0)
    pool = ReplicaPool([s.url for s in servers], config, clock=clock)
    down = pool.replicas[0]

    async def scenario() -> None:
        pool.record_failure(down, "connection refused")
        assert down.alive  # one failure is below the threshold
        pool.release(pool.acquire(), None)  # type: ignore[arg-type]  # replica 0 succeeds: count reset
        pool.record_failure(down, "connection refused")
        assert down.alive
        pool.record_failure(down, "timeout")
        assert not down.alive
        assert {pool.acquire().index for _ in range(3)} == {1}  # type: ignore[union-attr]
        pool.mark_loaded(pool.replicas[1], 2)  # the run moved on while it was out
        clock.now += 9.0
        await pool.probe_due()
        assert servers[0].calls == [] and not down.alive  # not due before retry_s
        clock.now += 1.0
        servers[0].step = None  # restarted: it serves the base model
        await pool.probe_due()
        assert servers[0].calls == ["/health"] and down.alive and down.loaded_step == 0
        assert all(pool.acquire().index == 1 for _ in range(2))  # type: ignore[union-attr]  # not on step 2
        await pool.aclose()

    asyncio.run(scenario())
    metrics = pool.metrics()
    assert metrics["replicas/deaths"] == 1 and metrics["replicas/alive"] == 2


def test_the_relay_fails_over_and_takes_a_dead_replica_out(servers: list[FakeServer]) -> None:
    urls = [refused_url(), servers[1].url]
    pool = ReplicaPool(urls, ReplicasConfig(max_failures=2, wait_s=0))

    async def scenario() -> list[dict]:
        async with pool, ReplicaRouter(pool) as base_url, httpx.AsyncClient() as client:
            answers = []
            for _ in range(4):
                response = await client.post(
                    f"{base_url.removesuffix('/v1')}/inference/v1/generate",
                    json={"token_ids": [1]},
                    headers={"Authorization": "Bearer k"},
                )
                assert response.status_code == 200
                answers.append(response.json())
            return answers

    answers = asyncio.run(scenario())
    assert answers == [{"server": "b", "auth": "Bearer k"}] * 4  # relayed with the caller's header
    dead = pool.replicas[0]
    # Calls 1 and 2 tried the dead replica first (least calls) and failed over; then it was out.
    assert not dead.alive and dead.num_failures == 2
    assert pool.num_failovers == 2
    assert servers[1].calls.count("/inference/v1/generate") == 4


def test_the_relay_answers_503_when_no_replica_is_left() -> None:
    pool = ReplicaPool([refused_url(), refused_url()], ReplicasConfig(max_failures=1, wait_s=0))

    async def scenario() -> httpx.Response:
        async with pool, ReplicaRouter(pool) as base_url, httpx.AsyncClient() as client:
            await client.post(f"{base_url}/chat/completions", json={})  # takes both out
            return await client.post(f"{base_url}/chat/completions", json={})

    response = asyncio.run(scenario())
    assert response.status_code == 503
    assert "no inference replica" in response.json()["error"]["message"]
    assert pool.alive == []


def publish(root: Path, step: int) -> None:
    (root / f"step_{step}").mkdir(parents=True)
    (root / f"step_{step}" / "STABLE").write_text("")


def test_weights_go_to_every_replica(tmp_path: Path, servers: list[FakeServer]) -> None:
    publish(tmp_path, 1)
    sync = PolicySync(tmp_path, [s.url for s in servers], poll_s=0.01, timeout_s=1)
    assert asyncio.run(sync.ensure(1)) == 1
    assert [s.calls for s in servers] == [["/update_weights"]] * 2
    assert [r.loaded_step for r in sync.pool.replicas] == [1, 1]


@pytest.mark.slow
def test_a_replica_that_cannot_load_is_taken_out_and_the_run_goes_on(
    tmp_path: Path, servers: list[FakeServer]
) -> None:
    servers[0].status = 500
    publish(tmp_path, 1)
    sync = PolicySync(tmp_path, [s.url for s in servers], poll_s=0.01, timeout_s=1)
    assert asyncio.run(sync.ensure(1)) == 1
    assert [r.alive for r in sync.pool.replicas] == [False, True]
    assert sync.pool.serving() == [sync.pool.replicas[1]]
    servers[1].status = 500
    publish(tmp_path, 2)
    with pytest.raises(WeightSyncError, match="no inference server could load the weights of step 2"):
        asyncio.run(sync.load_newest())


def test_a_refused_update_stops_the_run_with_replicas_too(tmp_path: Path, servers: list[FakeServer]) -> None:
    servers[1].status = 403
    publish(tmp_path, 1)
    sync = PolicySync(tmp_path, [s.url for s in servers], poll_s=0.01, timeout_s=1)
    with pytest.raises(WeightSyncError, match="http_403"):
        asyncio.run(sync.ensure(1))


def test_a_call_that_fails_on_every_serving_replica_is_a_502() -> None:
    pool = ReplicaPool([refused_url(), refused_url()], ReplicasConfig(max_failures=5, wait_s=0))

    async def scenario() -> httpx.Response:
        async with pool, ReplicaRouter(pool) as base_url, httpx.AsyncClient() as client:
            return await client.post(f"{base_url}/chat/completions", json={})

    response = asyncio.run(scenario())
    assert response.status_code == 502
    assert "failed on every inference replica" in response.json()["error"]["message"]
    assert [r.failures_in_a_row for r in pool.replicas] == [1, 1] and len(pool.alive) == 2


def test_any_answers_tells_a_dead_server_from_a_live_one(servers: list[FakeServer]) -> None:
    """The orchestrator's test of whether a step's failed rollouts are the servers' fault (then
    the step is not trained): False only when no replica's /health answers."""
    dead = ReplicaPool([refused_url(), refused_url()])
    live = ReplicaPool([refused_url(), servers[1].url])

    async def scenario(pool: ReplicaPool) -> bool:
        async with pool:
            return await pool.any_answers(timeout_s=2.0)

    assert asyncio.run(scenario(dead)) is False
    assert asyncio.run(scenario(live)) is True
    assert servers[1].calls == ["/health"]

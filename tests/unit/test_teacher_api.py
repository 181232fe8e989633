"""The teacher service's routes against hostile input: 4xx (never a 500) for nesting, huge integers,
cursors beyond SQLite's integers, bad trace ids and unknown traces; the secret on every path but
``/health``. The app runs in this process on 127.0.0.1 with its real trace worker process."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from prime_composer.config.teacher import TeacherServiceConfig
from prime_composer.inference.local import running_app
from prime_composer.teacher.ingest import TraceIngestor
from prime_composer.teacher.server import build_app
from prime_composer.teacher.traces import TraceError, parse_trace

SECRET = "api-test-secret-31"


def trace(trace_id: str = "t1", **extra: object) -> dict:
    return {
        "id": trace_id,
        "task": "Fix a.py",
        "turns": [
            {"role": "user", "content": "Fix a.py"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"name": "bash", "arguments": {"command": "ls"}}],
            },
        ],
        **extra,
    }


def nested(depth: int) -> object:
    value: object = 0
    for _ in range(depth):
        value = {"a": [value]}
    return value


@contextlib.contextmanager
def serving(tmp_path: Path, secret: str | None = None) -> Iterator[httpx.Client]:
    cfg = TeacherServiceConfig.model_validate(
        {"output_dir": str(tmp_path), "pool": [{"base_url": "http://127.0.0.1:9/v1", "model": "m"}]}
    )
    ingestor = TraceIngestor(cfg.store_path, cfg.traces)
    app, close = build_app(cfg, secret, ingestor)
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    try:
        with running_app(app) as url, httpx.Client(base_url=url, headers=headers, timeout=60) as client:
            yield client
    finally:
        ingestor.close()
        close()


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    with serving(tmp_path_factory.mktemp("teacher")) as c:
        assert c.post("/v1/traces", json={"traces": [trace("known")]}).json()["accepted"] == ["known"]
        yield c


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        (b'{"traces": [' + b"[" * 100_000 + b"]" * 100_000 + b"]}", "nested deeper than"),
        ({"traces": [nested(200)]}, "traces[0] is nested deeper than traces.max_json_depth = 64"),
        ({"traces": [trace("deep-info", info=nested(100))]}, "traces[0] is nested deeper than"),
        (b'{"traces": [{"id": "x", "reward": ' + b"9" * 5000 + b"}]}", "the body is not JSON"),
        (b"{", "the body is not JSON"),
        ({"trace": []}, 'the body must be {"traces"'),
    ],
    ids=["deep-body", "deep-trace", "deep-info", "5000-digit-int", "truncated", "wrong-shape"],
)
def test_hostile_bodies_are_400(client: httpx.Client, body: object, detail: str) -> None:
    response = (
        client.post("/v1/traces", content=body)
        if isinstance(body, bytes)
        else client.post("/v1/traces", json=body)
    )
    assert response.status_code == 400, response.text
    assert detail in response.json()["detail"]
    assert client.get("/health").json() == {"status": "ok"}


@pytest.mark.parametrize(
    ("trace_id", "error"),
    [
        ("../../\x00etc", "String should match pattern"),
        ("a/b", "String should match pattern"),
        (".hidden", "String should match pattern"),
        ("x" * 201, "at most 200 characters"),
    ],
)
def test_bad_trace_ids_are_rejected(client: httpx.Client, trace_id: str, error: str) -> None:
    body = client.post("/v1/traces", json={"traces": [trace(trace_id)]}).json()
    assert body["accepted"] == [] and body["rejected"][0]["index"] == 0
    assert error in body["rejected"][0]["error"]


def test_good_trace_ids_and_bounded_numbers(client: httpx.Client) -> None:
    ok = ["0f3c9a2b4d5e6f708192a3b4c5d6e7f8", "t-17", "run_3:ep.4@x+y=z"]
    assert client.post("/v1/traces", json={"traces": [trace(i) for i in ok]}).json()["accepted"] == ok
    huge_token = trace("huge-token")
    huge_token["turns"][1]["token_ids"] = [10**40]
    huge_exit = trace("huge-exit")
    huge_exit["turns"].append({"role": "tool", "content": "", "exit_code": 2**40})
    body = client.post("/v1/traces", json={"traces": [huge_token, huge_exit]}).json()
    assert [r["index"] for r in body["rejected"]] == [0, 1]
    assert all("should be less than" in r["error"] for r in body["rejected"])


@pytest.mark.parametrize("after", [str(10**40), str(2**63), "-1", "1e3", "x"])
def test_cursors_out_of_range_are_422(client: httpx.Client, after: str) -> None:
    response = client.get("/v1/pairs", params={"after": after})
    assert response.status_code == 422, response.text


def test_largest_cursor_is_answered(client: httpx.Client) -> None:
    assert client.get("/v1/pairs", params={"after": 2**63 - 1}).json() == {"pairs": [], "cursor": 2**63 - 1}


def test_process_rewards_of_an_unknown_trace_is_404(client: httpx.Client) -> None:
    assert client.get("/v1/process_rewards/known").json() == {"trace_id": "known", "rewards": {}}
    assert client.get("/v1/process_rewards/never-posted").status_code == 404
    assert client.get("/v1/process_rewards/..%2F..%2Fetc").status_code in (404, 422)
    assert client.get("/v1/process_rewards/a%00b").status_code == 422


def test_the_secret_guards_every_path_but_health(tmp_path: Path) -> None:
    with serving(tmp_path, SECRET) as authed:
        bare = httpx.Client(base_url=str(authed.base_url), timeout=30)
        assert bare.get("/health").status_code == 200
        for path in (
            "/openapi.json",
            "/docs",
            "/redoc",
            "/v1/stats",
            "/v1/pairs",
            "/v1/process_rewards/x",
            "/nope",
        ):
            assert bare.get(path).status_code == 401, path
            assert bare.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
        assert bare.post("/v1/traces", json={"traces": [trace()]}).status_code == 401
        assert authed.get("/openapi.json").json()["info"]["title"] == "prime-composer teacher"
        assert authed.get("/v1/stats").status_code == 200
        bare.close()


def test_files_reject_deep_lines_one_by_one(tmp_path: Path) -> None:
    import json

    from prime_composer.config.teacher import TraceSourceConfig
    from prime_composer.teacher.traces import read_trace_file

    path = tmp_path / "t.jsonl"
    lines = [
        json.dumps(trace("ok")),
        "[" * 100_000 + "]" * 100_000,
        json.dumps(trace("deep", info=nested(80))),
    ]
    path.write_text("\n".join(lines) + "\n")
    result = read_trace_file(path, TraceSourceConfig())
    assert [t.trace_id for _, t in result.traces] == ["ok"]
    assert [n for n, _ in result.errors] == [2, 3]
    assert all("nested deeper than traces.max_json_depth = 64" in e for _, e in result.errors)
    with pytest.raises(TraceError, match="nested deeper"):
        parse_trace(trace("x", info=nested(70)), "here", TraceSourceConfig())

"""``uv run teacher`` as a serving process: routes, the shared secret, traces over HTTP, pairs out,
SIGTERM; API keys never reaching logs, the store or the resolved config.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import tomli_w

from prime_composer.inference.local import running_app
from prime_composer.teacher.fakes import fake_teacher_app, fixed

PYTEST = {"tool": "bash", "arguments": {"command": "pytest -q"}}
SECRET = "route-secret-7f3a"
API_KEY = "sk-live-teacher-key-91c2"


def trace(name: str, task: str) -> dict:
    return {
        "id": name,
        "task": task,
        "turns": [
            {"role": "user", "content": task},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"name": "bash", "arguments": {"command": "ls"}}],
            },
            {"role": "tool", "content": "a.py", "exit_code": 0},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"name": "bash", "arguments": {"command": "pytest -q"}}],
            },
            {"role": "tool", "content": "1 failed", "exit_code": 1},
        ],
    }


def command(config: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "prime_composer.teacher.main", "@", str(config), *extra]


def write_config(path: Path, **fields) -> Path:
    path.write_text(tomli_w.dumps(fields))
    return path


@pytest.mark.slow
def test_serving_process_routes_secret_and_pairs(tmp_path):
    apps = {"a": fake_teacher_app(fixed(PYTEST)), "b": fake_teacher_app(fixed(PYTEST))}
    traces = tmp_path / "traces.jsonl"
    traces.write_text(json.dumps(trace("from-file", "Fix a.py")) + "\n{oops\n")
    env = {**os.environ, "TEACHER_SECRET": SECRET, "TEACHER_A_KEY": API_KEY}
    with running_app(apps["a"]) as url_a, running_app(apps["b"]) as url_b:
        config = write_config(
            tmp_path / "teacher.toml",
            output_dir=str(tmp_path / "run"),
            port=0,
            secret_env="TEACHER_SECRET",
            poll_s=0.2,
            traces={"files": [str(traces)]},
            gate={"enabled": False, "cascade": False},
            pool=[
                {
                    "name": "a",
                    "base_url": f"{url_a}/v1",
                    "model": "ma",
                    "api_key_env": "TEACHER_A_KEY",
                    "input_usd_per_m": 1.0,
                },
                {"name": "b", "base_url": f"{url_b}/v1", "model": "mb", "input_usd_per_m": 2.0},
            ],
        )
        dry = subprocess.run(
            command(config, "--dry-run"), env=env, capture_output=True, text=True, check=True
        )
        assert (
            API_KEY not in dry.stdout
            and SECRET not in dry.stdout
            and '"api_key_env": "TEACHER_A_KEY"' in dry.stdout
        )

        log = tmp_path / "teacher.log"
        with open(log, "wb") as err:
            process = subprocess.Popen(command(config), env=env, stdout=subprocess.DEVNULL, stderr=err)
        try:
            address = tmp_path / "run" / "teacher" / "service.json"
            deadline = time.monotonic() + 60
            while not address.exists():
                assert process.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            url = json.loads(address.read_text())["url"]
            assert url.startswith("http://127.0.0.1:")
            auth = {"Authorization": f"Bearer {SECRET}"}
            with httpx.Client(base_url=url, timeout=30) as client:
                assert client.get("/health").json() == {"status": "ok"}  # no secret needed
                assert client.get("/v1/stats").status_code == 401
                assert client.get("/v1/stats", headers={"Authorization": "Bearer wrong"}).status_code == 401
                assert client.get("/v1/stats", headers=auth).json()["import_errors"] == 1

                posted = client.post(
                    "/v1/traces",
                    headers=auth,
                    json={"traces": [trace("from-http", "Fix b.py"), {"id": "bad", "turns": []}, "nope"]},
                ).json()
                assert posted["accepted"] == ["from-http"]
                assert [r["index"] for r in posted["rejected"]] == [1, 2]
                assert "turns: List should have at least 1 item" in posted["rejected"][0]["error"]
                assert client.post("/v1/traces", headers=auth, content=b"{").status_code == 400

                deadline = time.monotonic() + 180  # the reference model loads on the first pair
                while True:
                    body = client.get("/v1/pairs", headers=auth, params={"after": 0}).json()
                    if len(body["pairs"]) == 2 or time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
                assert {(p["trace_id"], p["turn_index"]) for p in body["pairs"]} == {
                    ("from-file", 1),
                    ("from-http", 1),
                }
                assert body["cursor"] == 2
                assert client.get("/v1/pairs", headers=auth, params={"after": 2}).json() == {
                    "pairs": [],
                    "cursor": 2,
                }
                rewards = client.get("/v1/process_rewards/from-http", headers=auth).json()["rewards"]
                assert rewards == {"1": -1.0, "3": 1.0}
        finally:
            process.send_signal(signal.SIGTERM)
            code = process.wait(timeout=60)
    assert code == 0, log.read_text()[-2000:]
    # The key was sent to teacher a as a bearer token, and is nowhere in the log or the store.
    assert {r["authorization"] for r in apps["a"].state.requests} == {f"Bearer {API_KEY}"}
    assert {r["authorization"] for r in apps["b"].state.requests} == {None}
    assert API_KEY not in log.read_text() and SECRET not in log.read_text()
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert API_KEY.encode() not in data and SECRET.encode() not in data, path


@pytest.mark.parametrize(
    ("fields", "env", "message"),
    [
        ({"host": "0.0.0.0"}, {}, "teacher.host = '0.0.0.0' is reachable beyond this machine"),
        ({"secret_env": "NOT_SET_ANYWHERE"}, {}, "teacher.secret_env = 'NOT_SET_ANYWHERE'"),
        (
            {"pool": [{"base_url": "http://127.0.0.1:9/v1", "model": "m", "api_key_env": "NO_SUCH_KEY"}]},
            {},
            "NO_SUCH_KEY",
        ),
        ({"pool": []}, {}, "teacher.pool is empty"),
        ({"pol": []}, {}, "unknown key 'pol' (did you mean 'pool'?)"),
    ],
)
def test_start_up_errors_are_one_clear_line(tmp_path, fields, env, message):
    base = {
        "output_dir": str(tmp_path),
        "pool": [{"base_url": "http://127.0.0.1:9/v1", "model": "m"}],
        "serve": True,
    }
    config = write_config(tmp_path / "t.toml", **{**base, **fields})
    result = subprocess.run(
        command(config), env={**os.environ, **env}, capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr

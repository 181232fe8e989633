"""The ``teacher`` process under faults: SIGKILL mid-run and a poisoned trace file.

The service runs as a real subprocess (``python -m prime_composer.teacher.main @ teacher.toml
--no-serve``); its teachers are slow fake endpoints served by this test process on 127.0.0.1, which
log every request they receive, so the test can see exactly what the service paid for before and
after the kill.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomli_w

from prime_composer.inference.local import running_app
from prime_composer.teacher.fakes import fake_teacher_app, fixed

PYTEST = {"tool": "bash", "arguments": {"command": "pytest -q"}}
NUM_TRACES = 12


def coding_trace(i: int) -> dict:
    task = f"Make the tests in pkg{i}/ pass."

    def call(name: str, **args: str) -> dict:
        return {"role": "assistant", "content": "", "tool_calls": [{"name": name, "arguments": args}]}

    return {
        "id": f"t{i:02d}",
        "task": task,
        "turns": [
            {"role": "user", "content": task},
            call("bash", command=f"ls pkg{i}"),
            {"role": "tool", "content": "mod.py test_mod.py", "exit_code": 0},
            call("str_replace", path=f"pkg{i}/mod.py", old_str="a + b", new_str="a - b"),
            {"role": "tool", "content": "edited", "exit_code": 0},
            call("bash", command="pytest -q"),
            {"role": "tool", "content": "1 failed", "exit_code": 1},
            {"role": "assistant", "content": "Done."},
        ],
    }


def write_traces(path: Path) -> None:
    lines = [json.dumps(coding_trace(i)) for i in range(NUM_TRACES)]
    lines.insert(3, '{"id": "broken", "turns": [')  # bad JSON
    lines.insert(7, json.dumps({"id": "no-turns", "task": "x"}))  # missing field
    huge = coding_trace(99)
    huge["turns"][2]["content"] = "y" * 300_000  # a runaway tool result
    lines.insert(9, json.dumps(huge))
    path.write_text("\n".join(lines) + "\n")


def service(config: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PRIME_COMPOSER_LOG_LEVEL": "INFO"}
    return subprocess.Popen(
        [sys.executable, "-m", "prime_composer.teacher.main", "@", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=open(log, "ab"),  # the child keeps the file; ours closes with the test
        env=env,
    )


def query(db: Path, sql: str) -> list[tuple]:
    if not db.exists():
        return []
    with sqlite3.connect(db, timeout=30) as conn:
        try:
            return conn.execute(sql).fetchall()
        except sqlite3.OperationalError:  # tables not created yet
            return []


@pytest.mark.slow
def test_sigkill_mid_run_resumes_without_repaying_or_duplicating(tmp_path):
    apps = {name: fake_teacher_app(fixed(PYTEST), fault="slow", delay_s=0.15) for name in ("a", "b")}
    traces = tmp_path / "traces.jsonl"
    write_traces(traces)
    log = tmp_path / "teacher.log"
    db = tmp_path / "run" / "teacher" / "teacher.sqlite"
    with running_app(apps["a"]) as url_a, running_app(apps["b"]) as url_b:
        config = tmp_path / "teacher.toml"
        config.write_text(
            tomli_w.dumps(
                {
                    "output_dir": str(tmp_path / "run"),
                    "serve": False,
                    "max_concurrent_steps": 2,
                    "traces": {"files": [str(traces)], "max_turn_chars": 100_000},
                    "gate": {"enabled": False, "cascade": False},
                    "budget": {"per_trace_usd": 1.0},
                    "reference": {"batch_size": 16},
                    "pool": [
                        {
                            "name": n,
                            "base_url": f"{u}/v1",
                            "model": f"m-{n}",
                            "input_usd_per_m": 1.0,
                            "output_usd_per_m": 2.0,
                        }
                        for n, u in (("a", url_a), ("b", url_b))
                    ],
                }
            )
        )
        first = service(config, log)
        deadline = time.monotonic() + 120
        while len(query(db, "SELECT 1 FROM ledger WHERE outcome = 'ok'")) < 12:
            assert first.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the service made no progress"
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        killed_at = time.time()
        cached_at_kill = set(query(db, "SELECT model, prompt_hash FROM responses"))
        labeled_at_kill = query(db, "SELECT COUNT(*) FROM steps WHERE status = 'done'")[0][0]
        assert 0 < labeled_at_kill < NUM_TRACES * 4, "the kill should land mid-run"

        second = service(config, log)
        assert second.wait(timeout=300) == 0, log.read_text()[-3000:]
        requests = [(r, name) for name, app in apps.items() for r in app.state.requests]

    # Nothing the store had cached at the kill was requested again.
    after = [(r["model"], r["key"]) for r, _ in requests if r["time"] > killed_at]
    assert after and not set(after) & cached_at_kill
    # Each answer was paid for once (a call in flight at the kill may have been made twice, but
    # it was never recorded, so it is never counted twice either).
    paid = query(
        db, "SELECT cache_key, COUNT(*) FROM ledger WHERE outcome IN ('ok', 'malformed') GROUP BY cache_key"
    )
    assert len(paid) == NUM_TRACES * 4 * 2 and all(count == 1 for _, count in paid)
    assert len(requests) - len(paid) <= 2 * 2  # at most the calls in flight (2 steps x 2 teachers)
    # Every trace finished; each wrong step is exactly one ready pair.
    assert query(db, "SELECT status, COUNT(*) FROM traces GROUP BY status") == [("done", NUM_TRACES)]
    pairs = query(db, "SELECT trace_id, turn_index, status FROM pairs")
    assert len(pairs) == NUM_TRACES * 3 == len({(t, k) for t, k, _ in pairs})
    assert {s for _, _, s in pairs} == {"ready"}
    assert sorted(c for (c,) in query(db, "SELECT cursor FROM pairs")) == list(range(1, NUM_TRACES * 3 + 1))

    # The poisoned lines were rejected one by one, with the reason, and nothing else was lost.
    errors = dict(
        ((line, error) for _, line, error in query(db, "SELECT source, line, error FROM import_errors"))
    )
    assert sorted(errors) == [4, 8, 10]
    assert "not valid JSON" in errors[4] and "turns: Field required" in errors[8]
    assert "turns.2.content has 300000 characters" in errors[10]
    text = log.read_text()
    assert f"rejected trace: {traces}:4: not valid JSON" in text

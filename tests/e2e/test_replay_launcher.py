"""The replay channel through the real launcher: ``rl`` starts the teacher service beside the other
processes, the orchestrator posts its rollouts to it as traces, the service asks its teachers,
turns their disagreement with the rollouts into DPO pairs with reference logprobs, and the trainer
trains on them (``loss/replay``).

The teachers are two endpoints of a small oracle served by the test (it answers the arithmetic
questions right, in the teacher protocol's ``{"message": ...}`` form): what an external frontier
model would do for this task, without a network.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from .conftest import free_port, run_rl

pytestmark = pytest.mark.slow


class Oracle(BaseHTTPRequestHandler):
    """``/v1/chat/completions``: the right sum of the last ``What is a + b?`` in the transcript."""

    calls = 0

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = " ".join(m.get("content") or "" for m in body["messages"])
        found = re.findall(r"What is (\d+) \+ (\d+)\?", text)
        answer = str(int(found[-1][0]) + int(found[-1][1])) if found else "?"
        Oracle.calls += 1
        reply = {
            "id": "x",
            "object": "chat.completion",
            "model": body.get("model", "oracle"),
            "choices": [
                {"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": json.dumps({"message": answer})}}
            ],
            "usage": {"prompt_tokens": 50, "completion_tokens": 5, "total_tokens": 55},
        }  # fmt: skip
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def test_teacher_pairs_reach_the_trainer(tmp_path: Path) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Oracle)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    oracle = f"http://127.0.0.1:{server.server_address[1]}/v1"
    pool = f'[{{name = "oracle-a", base_url = "{oracle}", model = "a"}}, {{name = "oracle-b", base_url = "{oracle}", model = "b"}}]'
    try:
        proc = run_rl(
            tmp_path,
            "--max-steps", "6",
            "--warmup.max-steps", "40",
            "--orchestrator.eval.interval", "0",
            "--ckpt.interval", "0",
            "--teacher.port", str(free_port()),
            "--teacher.pool", pool,
            "--teacher.poll-s", "0.5",
            "--teacher.gate.min-score", "0.0",
            "--orchestrator.replay.enabled",
            "--orchestrator.replay.pairs-per-step", "16",
            "--trainer.loss.replay.weight", "0.1",
            timeout=1200,
        )  # fmt: skip
    finally:
        server.shutdown()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "logs" / "teacher.log").exists() and Oracle.calls > 0
    orchestrator = [
        json.loads(line) for line in (tmp_path / "metrics" / "orchestrator.jsonl").read_text().splitlines()
    ]
    trainer = [json.loads(line) for line in (tmp_path / "metrics" / "trainer.jsonl").read_text().splitlines()]
    assert max(r.get("replay/traces_sent", 0) for r in orchestrator) > 0
    assert sum(r.get("replay/packed_pairs", 0) for r in orchestrator) > 0, "no pair reached a batch"
    trained = [r for r in trainer if r.get("replay/num_pairs", 0) > 0]
    assert trained and all("loss/replay" in r and "dpo/accuracy" in r for r in trained)

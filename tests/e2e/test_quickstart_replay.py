"""``rl @ configs/quickstart-replay.toml``, shrunk: the replay channel with real local teachers.

The launcher fine-tunes two tiny teacher models on the warm-up data (they play the agent), serves
each with the embedded inference server, starts the teacher service beside the other processes;
the orchestrator posts its rollouts to the service as traces, the teachers' answers (real
generations over HTTP) become DPO pairs with reference logprobs, the trainer trains on them
(``loss/replay``), and the teachers' process rewards shape the advantages of later rollouts at the
states they labeled. Frozen traces with wrong answers are imported at start too, so pairs exist
while the run is young. Progress and the report show pairs, spend and agreement.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from .conftest import free_port, run_rl

pytestmark = pytest.mark.slow

TEACHER_STEPS = 100  # most sums already (the shipped config uses 300)


def records(output_dir: Path, process: str) -> list[dict]:
    return [
        json.loads(line) for line in (output_dir / "metrics" / f"{process}.jsonl").read_text().splitlines()
    ]


def test_quickstart_replay_trains_on_pairs_from_local_teachers(tmp_path: Path) -> None:
    frozen = tmp_path / "frozen.jsonl"
    frozen.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"frozen-{a}-{b}",
                    "turns": [
                        {"role": "user", "content": f"What is {a} + {b}?"},
                        {"role": "assistant", "content": str(a + b + 1)},
                    ],
                    "reward": 0.0,
                }
            )
            + "\n"
            for a in range(4)
            for b in range(3)
        )
    )
    teacher = "{{name = '{n}', model = '{n}', input_usd_per_m = 0.15, output_usd_per_m = 0.6, max_tokens = 24, protocol = 'agent', local = {{warmup_steps = {s}, warmup_lr = 1e-3, seed = {seed}, seq_len = 128}}}}"
    pool = (
        "["
        + ", ".join(
            teacher.format(n=n, s=TEACHER_STEPS, seed=i + 1) for i, n in enumerate(("teacher-a", "teacher-b"))
        )
        + "]"
    )
    proc = run_rl(
        tmp_path / "run",
        "--max-steps", "8",
        "--warmup.max-steps", "40",
        "--orchestrator.eval.interval", "0",
        "--ckpt.interval", "0",
        "--teacher.port", str(free_port()),
        "--teacher.pool", pool,
        "--teacher.traces.files", f'["{frozen}"]',
        "--orchestrator.advantage.process-reward-weight", "0.5",
        config="quickstart-replay.toml",
        timeout=1500,
    )  # fmt: skip
    run = tmp_path / "run"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("teacher-a", "teacher-b"):
        assert (run / "teachers" / name / "sft" / "final" / "config.json").exists()
        assert (run / "logs" / f"teacher-{name}.log").exists()

    # Both teachers answered with real generations that parsed as actions, and were billed.
    store = sqlite3.connect(run / "teacher" / "teacher.sqlite")
    ok = dict(store.execute("SELECT teacher, COUNT(*) FROM ledger WHERE outcome = 'ok' GROUP BY teacher"))
    assert set(ok) == {"teacher-a", "teacher-b"}, ok
    spent = store.execute("SELECT SUM(dollars) FROM ledger").fetchone()[0]
    assert 0 < spent <= 1.0

    orchestrator, trainer, teacher_metrics = (records(run, p) for p in ("orchestrator", "trainer", "teacher"))
    assert max(r.get("replay/traces_sent", 0) for r in orchestrator) > 0
    assert sum(r.get("replay/packed_pairs", 0) for r in orchestrator) > 0, "no pair reached a batch"
    trained = [r for r in trainer if r.get("replay/num_pairs", 0) > 0]
    assert trained and all("loss/replay" in r and "dpo/accuracy" in r for r in trained)
    assert max(r.get("replay/shaping_shaped", 0) for r in orchestrator) > 0, "no rollout was shaped"
    last = teacher_metrics[-1]
    assert last["teacher/spent_usd"] == pytest.approx(spent) and 0 <= last["teacher/agreement_rate"] <= 1

    # The progress lines and the report show the channel.
    assert "pairs=" in proc.stdout and "spend $=" in proc.stdout and "agree=" in proc.stdout
    assert "replay: " in proc.stdout and "teachers: $" in proc.stdout

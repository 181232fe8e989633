"""bench/replay.py's per-teacher accuracy, counted by hand from stored votes: right answers at the
planted steps, agreement with the oracle's own action in the oracle's episodes, refusals left out."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "replay.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_replay", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_replay"] = module
    spec.loader.exec_module(module)
    return module


def step(trace_id, turn_index, action_key, *votes):
    records = [{"teacher": t, "outcome": o, "action": a} for t, o, a in votes]
    return {
        "trace_id": trace_id,
        "turn_index": turn_index,
        "action_key": action_key,
        "votes": json.dumps(records),
    }


def test_accuracy_at_planted_steps_and_agreement_with_the_oracle():
    steps = [
        # planted: the right action is R (the trace's own action W is the mistake)
        step("noop-001", 1, "W", ("strong", "ok", "R"), ("weak", "ok", "W")),
        step("wrong_fix-002", 5, "W", ("strong", "ok", "R"), ("weak", "malformed", None)),
        # the oracle's episode: agreeing means answering its own action
        step("oracle-000", 1, "A", ("strong", "ok", "A"), ("weak", "ok", "B")),
        step("oracle-000", 3, "C", ("strong", "ok", "X"), ("weak", "budget", None)),
        # an ordinary step of a failed episode: counted in neither
        step("noop-001", 3, "Z", ("strong", "ok", "Z"), ("weak", "ok", "Z")),
    ]
    right = {("noop-001", 1): "R", ("wrong_fix-002", 5): "R"}
    accuracy = _bench().teacher_accuracy(steps, right)
    assert accuracy == {
        "strong": {"planted": 2 / 2, "oracle": 1 / 2},
        "weak": {"planted": 0 / 2, "oracle": 0 / 1},  # the refusal is no answer
    }

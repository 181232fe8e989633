"""Step-DPO in the replay loop: each trace is labeled in turn order up to the first step the
teachers judge wrong, whose pair has the student's own correction as its chosen side; the steps
after it are never asked (no teacher call, no dollar)."""

from __future__ import annotations

import json

import pytest
from test_teacher_replay import PYTEST, coding_trace, make_config, outcomes, replay, serving, student_app

from prime_composer.config.teacher import PairConfig
from prime_composer.teacher.fakes import fake_teacher_app
from prime_composer.teacher.pool import StudentSampler

LS = {"tool": "bash", "arguments": {"command": "ls calc"}}


def reads_first(messages: list[dict[str, str]]) -> dict:
    """Agrees with the trace's first step (``ls calc``), then wants the tests run."""
    seen = "calc.py test_calc.py" in json.dumps(messages)
    return PYTEST if seen else LS


def run(tmp_path, step_dpo: bool):
    matching = '<tool_call>\n{"name": "bash", "arguments": {"command": "pytest -q"}}\n</tool_call>'
    teachers = {"a": fake_teacher_app(reads_first), "b": fake_teacher_app(reads_first)}
    with serving({**teachers, "student": student_app([(matching, [11, 12])])}) as urls:
        student_url = urls.pop("student")
        on_policy = {"enabled": True, "base_url": student_url, "model": "policy", "require_match": True}
        cfg = make_config(tmp_path, urls, pairs={"on_policy": on_policy, "step_dpo": step_dpo})
        store = replay(cfg, [coding_trace("t")], student=StudentSampler(cfg.pairs.on_policy, seed=0))
        calls = {name: len(app.state.requests) for name, app in teachers.items()}
    return store, calls


def test_step_dpo_stops_at_the_first_wrong_step(tmp_path):
    # The trace's steps: 1 ls (the teachers agree), 3 a wrong edit (they want pytest), 5 pytest, 7 "Done.".
    plain, plain_calls = run(tmp_path / "plain", step_dpo=False)
    assert outcomes(plain) == {1: "confirmed", 3: "pair", 5: "confirmed", 7: "pair"}
    assert plain_calls == {"a": 4, "b": 4}
    store, calls = run(tmp_path / "step", step_dpo=True)
    assert outcomes(store) == {1: "confirmed", 3: "pair", 5: "after_error", 7: "after_error"}
    assert calls == {"a": 2, "b": 2}  # steps 5 and 7 were never asked
    (pair,) = store.pairs_needing_reference(10)
    assert pair["turn_index"] == 3 and pair["chosen_source"] == "student"
    assert json.loads(pair["chosen_ids"]) == [11, 12]
    assert store.stats()["spent_usd"] < plain.stats()["spent_usd"]


def test_step_dpo_needs_an_on_policy_chosen_side():
    with pytest.raises(ValueError, match="require_match = true"):
        PairConfig(
            step_dpo=True, on_policy={"enabled": True, "base_url": "http://127.0.0.1:1/v1", "model": "m"}
        )

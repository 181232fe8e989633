"""Canonical actions, parsing teacher answers, and turning votes into labels."""

from __future__ import annotations

import json

import pytest

from prime_composer.config.teacher import PairConfig
from prime_composer.teacher.actions import (
    Action,
    ParseError,
    action_from_json,
    action_to_json,
    canonical_call,
    parse_answer,
    render_action,
)
from prime_composer.teacher.votes import Vote, label_step


def call(name, **arguments) -> Action:
    return Action(calls=(canonical_call(name, arguments),))


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (call("bash", command="pytest -q tests/"), call("bash", command="pytest  -q 'tests/'")),
        (call("bash", command="python -m pytest -x"), call("shell", command="pytest -x")),
        (
            call("Edit", path="./src//calc.py", new_str="x = 1\r\n"),
            call("edit", path="src/calc.py", new_str="x = 1  "),
        ),
        (
            Action(calls=(canonical_call("edit", '{"path": "a.py", "old_str": "a", "new_str": "b"}'),)),
            call("edit", new_str="b", old_str="a", path="a.py"),
        ),
        (Action(message="The  answer is 42."), Action(message="the answer is 42.")),
    ],
)
def test_equivalent_actions_share_a_key(a, b):
    assert a.key == b.key


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (call("bash", command="pytest -q"), call("bash", command="pytest -x")),
        (call("edit", path="a.py", new_str="x"), call("edit", path="b.py", new_str="x")),
        (call("bash", command="ls"), Action(message="ls")),
        (call("bash", command="echo 'a b'"), call("bash", command="echo a b")),  # quoting that changes words
    ],
)
def test_different_actions_differ(a, b):
    assert a.key != b.key


def test_parse_answer_forms():
    target = call("bash", command="pytest -q")
    bare = {"content": '{"tool": "bash", "arguments": {"command": "pytest -q"}}'}
    fenced = {
        "content": 'Let me run the tests.\n```json\n{"name": "bash", "arguments": {"command": "pytest  -q"}}\n```'
    }
    tagged = {
        "content": '<think>hmm {"tool": "x"}</think><tool_call>\n{"name": "bash", "arguments": {"command": "pytest -q"}}\n</tool_call>'
    }
    native = {
        "content": None,
        "tool_calls": [
            {
                "id": "1",
                "type": "function",
                "function": {"name": "bash", "arguments": '{"command": "pytest -q"}'},
            }
        ],
    }
    for message in (bare, fenced, tagged, native):
        assert parse_answer(message).key == target.key, message
    assert parse_answer({"content": 'Answer: {"message": "Done."}'}) == Action(message="Done.")


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("", "empty"),
        ("I would run the tests.", "no JSON object"),
        ('{"thought": "x"}', "neither"),
        ("[1, 2]", "no JSON object"),
    ],
)
def test_malformed_answers(content, reason):
    with pytest.raises(ParseError, match=reason):
        parse_answer({"content": content})


def test_render_parses_back_and_json_round_trip():
    action = Action(
        calls=(
            canonical_call("edit", {"path": "a.py", "new_str": "def f():\n    return 1"}),
            canonical_call("bash", {"command": "pytest"}),
        )
    )
    assert parse_answer({"content": render_action(action)}) == action
    assert action_from_json(json.loads(json.dumps(action_to_json(action)))) == action


# ----------------------------------------------------------------------------------------- votes

PYTEST, LS, CAT = call("bash", command="pytest"), call("bash", command="ls"), call("bash", command="cat a.py")


def votes(*actions) -> list[Vote]:
    return [Vote(f"t{i}", a) for i, a in enumerate(actions)]


def test_unanimous_disagreement_is_a_pair_without_smoothing():
    label = label_step(LS, votes(PYTEST, PYTEST, PYTEST), PairConfig(kappa=0.6, delta=0.34))
    assert label.outcome == "pair" and label.chosen == PYTEST
    assert label.best_share == 1.0 and label.trace_share == 0.0 and label.process_reward == -1.0
    assert label.label_smoothing == 0.0 and label.clusters == {PYTEST.key: ["t0", "t1", "t2"]}


def test_two_of_three_is_a_pair_with_smoothing_one_third():
    label = label_step(LS, votes(PYTEST, CAT, PYTEST), PairConfig(kappa=0.6, delta=0.34))
    assert label.outcome == "pair" and label.label_smoothing == pytest.approx(1 / 3)
    assert label.process_reward == pytest.approx(-2 / 3)


def test_margin_delta_blocks_a_pair_when_the_trace_has_votes_too():
    # 3 of 5 for pytest, 2 of 5 for the trace's ls: share 0.6 >= kappa but margin 0.2 < delta.
    label = label_step(LS, votes(PYTEST, LS, PYTEST, LS, PYTEST), PairConfig(kappa=0.6, delta=0.34))
    assert label.outcome == "undecided" and label.margin == pytest.approx(0.2)
    assert label.process_reward == pytest.approx(-0.2)


def test_confirmation_abstentions_and_no_votes():
    cfg = PairConfig(kappa=0.6)
    confirmed = label_step(LS, [Vote("a", LS), Vote("b", None, error="timeout"), Vote("c", LS)], cfg)
    assert confirmed.outcome == "confirmed" and confirmed.num_votes == 2 and confirmed.process_reward == 1.0
    assert label_step(LS, [Vote("a", None), Vote("b", None)], cfg).outcome == "no_votes"
    # One valid vote against the trace: below min_votes = 2, so no pair.
    assert label_step(LS, [Vote("a", PYTEST), Vote("b", None)], cfg).outcome == "undecided"


def test_ties_go_to_the_earliest_vote():
    cfg = PairConfig(kappa=0.5, delta=0.5)
    label = label_step(LS, votes(CAT, PYTEST, PYTEST, CAT), cfg)
    assert label.outcome == "pair" and label.chosen == CAT

"""``prompts.agent_messages``: the state as an OpenAI chat an agent server accepts (the shape the
conformance rules of ``inference/conformance.py`` require), with the trace's calls as
``tool_calls`` and each result answering its call."""

from __future__ import annotations

import json

import pytest

from prime_composer.inference.conformance import check_tool_messages
from prime_composer.inference.guard import APIError
from prime_composer.teacher.prompts import agent_messages, student_messages
from prime_composer.teacher.traces import TraceSourceConfig, parse_trace


def trace_of(*turns, task="fix it"):
    return parse_trace({"task": task, "turns": list(turns)}, "test", TraceSourceConfig())


def call(name, call_id=None, **arguments):
    return {"name": name, "arguments": arguments, **({"id": call_id} if call_id else {})}


SYSTEM = {"role": "system", "content": "You fix code."}
USER = {"role": "user", "content": "The tests fail."}


def test_a_multi_turn_state_is_a_conformant_chat_with_the_traces_calls():
    trace = trace_of(
        SYSTEM,
        USER,
        {"role": "assistant", "content": "", "tool_calls": [call("run_tests", "c1")]},
        {"role": "tool", "content": "1 failed", "tool_call_id": "c1", "name": "run_tests", "exit_code": 1},
        {"role": "assistant", "content": "Reading.", "tool_calls": [call("read_file", "c2", path="calc.py")]},
        {"role": "tool", "content": "def add(a, b): ...", "tool_call_id": "c2", "name": "read_file"},
        {"role": "assistant", "content": "", "tool_calls": [call("run_tests", "c3")]},
    )
    student = student_messages(trace, 6)
    with pytest.raises(APIError, match="must answer a call"):  # what agent teachers were sent before
        check_tool_messages(student)
    messages = agent_messages(trace, 6)
    check_tool_messages(messages)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert messages[2] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "run_tests", "arguments": "{}"}}
        ],
    }
    assert messages[4]["content"] == "Reading."
    assert json.loads(messages[4]["tool_calls"][0]["function"]["arguments"]) == {"path": "calc.py"}
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "1 failed"}
    assert messages[5]["tool_call_id"] == "c2"
    # The same text and order as the student's own chat, only the calls' shape differs.
    assert [m["content"] for m in messages if m["role"] != "assistant"] == [
        m["content"] for m in student if m["role"] != "assistant"
    ]


def test_calls_without_ids_get_ids_and_results_answer_them_in_order():
    trace = trace_of(
        USER,
        {"role": "assistant", "content": "", "tool_calls": [call("ls"), call("cat", path="a")]},
        {"role": "tool", "content": "a"},
        {"role": "tool", "content": "x = 1", "tool_call_id": "unknown"},
        {"role": "assistant", "content": "done"},
    )
    messages = agent_messages(trace, 4)
    check_tool_messages(messages)
    ids = [c["id"] for c in messages[1]["tool_calls"]]
    assert ids == ["call_1_0", "call_1_1"]
    assert [m["tool_call_id"] for m in messages[2:4]] == ids


def test_a_result_of_no_call_and_a_call_without_result_stay_as_text():
    trace = trace_of(
        USER,
        {"role": "assistant", "content": "I will look."},  # no parsed call
        {"role": "tool", "content": "boom", "name": "bash", "exit_code": 2},
        {"role": "assistant", "content": "", "tool_calls": [call("run_tests", "k"), call("ls", "k2")]},
        {"role": "tool", "content": "ok", "tool_call_id": "k"},
        {"role": "user", "content": "go on"},
        {"role": "assistant", "content": "done"},
    )
    messages = agent_messages(trace, 6)
    check_tool_messages(messages)
    assert messages[2] == {"role": "user", "content": "Tool result (bash, exit code 2):\nboom"}
    assert [c["id"] for c in messages[3]["tool_calls"]] == ["k"]  # "k2" was never answered
    assert messages[3]["content"] == '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'


def test_a_trace_without_a_user_turn_gets_its_task_after_the_system_message():
    trace = trace_of(SYSTEM, {"role": "assistant", "content": "hi"}, task="Fix add.")
    assert agent_messages(trace, 1) == [SYSTEM, {"role": "user", "content": "Fix add."}]

"""Trace files: the schema, line-by-line rejection of poisoned lines, the verifiers importer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prime_composer.config.teacher import TraceSourceConfig
from prime_composer.teacher.traces import TraceError, parse_trace, read_trace_file, read_verifiers_file

LIMITS = TraceSourceConfig(max_line_bytes=4096, max_turns=8, max_turn_chars=500)


def good_trace(i: int = 0) -> dict:
    return {
        "id": f"t{i}",
        "task": "Fix calc.py",
        "turns": [
            {"role": "user", "content": "Fix calc.py so the tests pass."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"name": "bash", "arguments": {"command": "pytest"}}],
            },
            {"role": "tool", "name": "bash", "content": "1 failed", "exit_code": 1},
            {"role": "assistant", "content": "Done.", "logprobs": [-0.1, -0.5]},
        ],
        "reward": 0.0,
    }


def test_valid_trace_steps_and_state_hash():
    trace = parse_trace(good_trace(), "x:1", LIMITS)
    assert trace.trace_id == "t0" and trace.step_indices == [1, 3]
    # What a teacher sees before step 3 does not include token ids or logprobs of earlier turns.
    with_logprobs = good_trace()
    with_logprobs["turns"][1]["logprobs"] = [-1.0]
    assert parse_trace(with_logprobs, "x:2", LIMITS).state_hash(3) == trace.state_hash(3)
    assert trace.state_hash(1) != trace.state_hash(3)


def test_id_defaults_to_a_content_hash():
    data = good_trace()
    del data["id"]
    a, b = parse_trace(data, "a", LIMITS), parse_trace(dict(data), "b", LIMITS)
    assert a.trace_id == b.trace_id and len(a.trace_id) == 24
    data["reward"] = 1.0
    assert parse_trace(data, "c", LIMITS).trace_id != a.trace_id


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("turns"), r"turns: Field required"),
        (lambda d: d["turns"][0].update(role="robot"), r"turns\.0\.role: Input should be"),
        (
            lambda d: d["turns"][0].update(tool_calls=[{"name": "x"}]),
            r"tool_calls is only allowed on assistant",
        ),
        (lambda d: d["turns"][2].update(logprobs=[0.0]), r"logprobs is only allowed on assistant"),
        (lambda d: d.update(turnz=[]), r"turnz: Extra inputs are not permitted"),
        (lambda d: d.update(turns=[{"role": "user", "content": "hi"}]), r"no assistant turn"),
        (
            lambda d: d["turns"].extend([{"role": "user", "content": "x"}] * 6),
            r"10 turns, more than traces.max_turns = 8",
        ),
        (lambda d: d["turns"][0].update(content="y" * 501), r"turns\.0\.content has 501 characters"),
        (
            lambda d: d["turns"][1]["tool_calls"][0].pop("name"),
            r"turns\.1\.tool_calls\.0\.name: Field required",
        ),
    ],
)
def test_bad_traces_are_clear_errors(mutate, message):
    data = good_trace()
    mutate(data)
    with pytest.raises(TraceError, match=message) as info:
        parse_trace(data, "traces.jsonl:7", LIMITS)
    assert str(info.value).startswith("traces.jsonl:7: ")


def test_poisoned_file_rejects_bad_lines_and_keeps_the_rest(tmp_path: Path):
    path = tmp_path / "traces.jsonl"
    lines = [
        json.dumps(good_trace(0)),
        "{not json",
        json.dumps({"task": "no turns"}),
        "",
        json.dumps(good_trace(1)),
        json.dumps(
            {**good_trace(2), "turns": [{"role": "user", "content": "z" * 9000}]}
        ),  # line > 4096 bytes
        "[1, 2, 3]",
        json.dumps(good_trace(3)),
    ]
    path.write_text("\n".join(lines) + "\n")
    result = read_trace_file(path, LIMITS)
    assert [(n, t.trace_id) for n, t in result.traces] == [(1, "t0"), (5, "t1"), (8, "t3")]
    errors = dict(result.errors)
    assert sorted(errors) == [2, 3, 6, 7]
    assert "not valid JSON" in errors[2] and f"{path}:2" in errors[2]
    assert "turns: Field required" in errors[3]
    assert "longer than traces.max_line_bytes = 4096" in errors[6]
    assert "must be a JSON object" in errors[7]


def test_huge_last_line_without_newline_is_skipped(tmp_path: Path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(json.dumps(good_trace()).encode() + b"\n" + b"x" * 100_000)
    result = read_trace_file(path, LIMITS)
    assert len(result.traces) == 1 and result.errors[0][0] == 2


@pytest.fixture(scope="module")
def verifiers_file(tmp_path_factory) -> Path:
    """A traces.jsonl written by verifiers' own code (Episode + write_episode)."""
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.episode import Episode
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, Reward, Trace, TraceTask
    from verifiers.v1.types import AssistantMessage, ToolCall, ToolMessage, UserMessage
    from verifiers.v1.utils.trace_store import write_episode

    trace = Trace(
        task=TraceTask(type="Fix", data={"prompt": "fix it"}), agent=AgentInfo(config=AgentConfig())
    )
    call = ToolCall(id="c1", name="bash", arguments='{"command": "pytest -q"}')
    trace.nodes = [
        MessageNode(message=UserMessage(content="fix it"), token_ids=[1, 2, 3], mask=[False] * 3),
        MessageNode(
            parent=0,
            message=AssistantMessage(content="", tool_calls=[call]),
            sampled=True,
            token_ids=[4, 5, 6, 7],
            mask=[False, True, True, True],
            logprobs=[-0.1, -0.2, -0.3],
        ),
        MessageNode(
            parent=1,
            message=ToolMessage(tool_call_id="c1", content="1 failed"),
            token_ids=[8, 9],
            mask=[False, False],
        ),
        MessageNode(
            parent=2,
            message=AssistantMessage(content="fixed"),
            sampled=True,
            token_ids=[10, 11, 12],
            mask=[False, True, True],
            logprobs=[-0.5, -0.6],
        ),
    ]
    trace.rewards = {"tests": Reward(score=1.0, weight=0.5), "style": Reward(score=0.2)}
    out = tmp_path_factory.mktemp("vf")
    write_episode(out, Episode(task=trace.task, traces=[trace], ok=True))
    with open(out / "traces.jsonl", "a") as f:
        f.write('{"traces": "nope"}\n')
    return out / "traces.jsonl"


def test_verifiers_importer_keeps_turns_tokens_logprobs_and_reward(verifiers_file: Path):
    result = read_verifiers_file(verifiers_file, LIMITS)
    assert (
        len(result.traces) == 1
        and len(result.errors) == 1
        and "not a verifiers episode" in result.errors[0][1]
    )
    trace = result.traces[0][1]
    turns = trace.turns
    assert [t.role for t in turns] == ["user", "assistant", "tool", "assistant"]
    assert (
        turns[1].tool_calls[0].name == "bash"
        and turns[1].tool_calls[0].arguments == '{"command": "pytest -q"}'
    )
    assert turns[1].token_ids == [5, 6, 7] and turns[1].prompt_token_ids == [1, 2, 3, 4]
    assert turns[1].logprobs == [-0.1, -0.2, -0.3]
    assert turns[3].prompt_token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] and turns[3].token_ids == [11, 12]
    assert turns[2].tool_call_id == "c1" and turns[2].content == "1 failed"
    assert trace.record.reward == pytest.approx(0.7)
    assert trace.record.task["prompt"] == "fix it"  # the task's data (verifiers adds defaults beside it)

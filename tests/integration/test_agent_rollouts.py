"""Agentic episodes end to end: the pyfix environment, the agent harness, the real sandbox, and
scripted agents behind a token-in OpenAI-compatible server on 127.0.0.1.

An oracle gets reward 1, a no-op 0, an agent that writes broken tool calls 0 while the run goes
on; every sample's tokens are checked against what the server was sent and returned; the SFT
warm-up records are the oracle's episode; SDPO targets the turn a scripted error points to, with
a teacher context checked against an independent rendering of the hinted conversation.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from prime_composer.config.env import EnvConfig, RolloutConfig, SamplingConfig
from prime_composer.config.sdpo import HintConfig
from prime_composer.config.teacher import TraceSourceConfig
from prime_composer.model.resolve import resolve_model_name
from prime_composer.orchestrator import envs
from prime_composer.orchestrator.rollout import RolloutRunner
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.sdpo.hints import HintBuilder
from prime_composer.orchestrator.sdpo.target import sdpo_target
from prime_composer.orchestrator.trace_export import episode_trace, samples_to_traces
from prime_composer.teacher.traces import parse_trace

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "environments" / "pyfix"))

from pyfix.scripted import ScriptedServer, logprob  # noqa: E402
from pyfix.taskset import FUNCTIONS, oracle_replies  # noqa: E402

HINTS_DIR = REPO / "hints"
SECRET_VAR = "PC_TEST_SCRIPTED_SECRET"


@pytest.fixture(scope="module")
def tokenizer_path() -> str:
    return resolve_model_name("builtin:tiny-qwen3")


@pytest.fixture(scope="module")
def tok(tokenizer_path: str) -> Any:
    return AutoTokenizer.from_pretrained(tokenizer_path)


IS_ROOT = os.geteuid() == 0
SANDBOX_ROOT = Path(f"/var/lib/prime-composer/agentic-tests-{os.getpid()}")


@pytest.fixture(scope="module")
def pyfix(tokenizer_path: str) -> Iterator[envs.LoadedEnv]:
    # Scripted agents are trusted code: run them where isolation is impossible too.
    sandbox = {"root_dir": str(SANDBOX_ROOT)} if IS_ROOT else {"allow_unisolated": True}
    agent = {"tokenizer": tokenizer_path, "max_turns": 6, "time_limit_s": 60, "sandbox": sandbox}
    yield envs.load_env(EnvConfig(id="pyfix", agent=agent, eval_args={"split": "eval"}), 0)
    shutil.rmtree(SANDBOX_ROOT, ignore_errors=True)


@pytest.fixture(scope="module")
def server(tok: Any, pyfix: envs.LoadedEnv) -> Iterator[tuple[ScriptedServer, str]]:
    tasks = [t.data for t in pyfix.tasks("train") + pyfix.tasks("eval")]
    scripted = ScriptedServer(tok, tasks, secret="s3cret")
    os.environ[SECRET_VAR] = "s3cret"
    with scripted.serve() as base_url:
        yield scripted, base_url
    del os.environ[SECRET_VAR]


def play(
    pyfix: envs.LoadedEnv,
    base_url: str,
    agent: str,
    task_indices: list[int],
    *,
    group_size: int = 1,
    api_key_var: str = SECRET_VAR,
) -> list[list[Sample]]:
    tasks = pyfix.tasks()

    async def main() -> list[list[Sample]]:
        async with RolloutRunner(
            [pyfix],
            base_url=base_url,
            model=agent,
            sampling=SamplingConfig(max_tokens=200),
            rollout=RolloutConfig(max_concurrent=16),
            api_key_var=api_key_var,
        ) as runner:
            return await asyncio.gather(
                *(
                    runner.run_group(
                        pyfix, tasks[i], group_size=group_size, example_id=i, group_id=i, policy_step=3
                    )
                    for i in task_indices
                )
            )

    return asyncio.run(main())


def test_the_oracle_solves_every_function(server, pyfix) -> None:
    groups = play(pyfix, server[1], "oracle", list(range(len(FUNCTIONS))))
    for group in groups:
        (sample,) = group
        assert sample.error is None and sample.reward == 1.0, sample.error
        assert sample.episode.stop == "final_answer" and not sample.is_truncated
        assert sample.metrics["agent/num_tool_calls"] == 4.0 and sample.metrics["agent/tool_errors"] == 0.0
        assert sample.metrics["edited"] == 1.0 and sample.policy_step == 3


def test_the_rollout_log_line_counts_the_episodes_turns(server, pyfix, caplog) -> None:
    """verifiers logs ``turns=0`` for a trace without a message graph; an agent episode's line
    (ours) has its model turns: the oracle's five replies, the broken agent's six attempts."""
    with caplog.at_level(logging.INFO):
        play(pyfix, server[1], "oracle", [0])
        play(pyfix, server[1], "broken", [1])
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rollout done")]
    assert len(lines) == 2, lines
    assert "reward=1.000 turns=5 stop=final_answer" in lines[0]
    assert "reward=0.000 turns=6 stop=max_turns" in lines[1]


def test_noop_and_broken_agents_get_zero_and_the_run_goes_on(server, pyfix) -> None:
    ((noop,),), ((broken,),) = play(pyfix, server[1], "noop", [0]), play(pyfix, server[1], "broken", [1])
    assert noop.error is None and noop.reward == 0.0 and noop.episode.stop == "final_answer"
    assert noop.metrics["edited"] == 0.0
    # The grader's test output is left as feedback (about the last turn).
    assert (
        noop.episode.feedback[0]["kind"] == "failing_test"
        and "0 passed, 1 failed" in noop.episode.feedback[0]["text"]
    )
    assert broken.error is None and broken.reward == 0.0
    assert broken.episode.stop == "max_turns" and broken.is_truncated
    assert broken.metrics["agent/malformed_calls"] == 6.0 and broken.metrics["agent/num_tool_calls"] == 0.0
    assert broken.episode.error_turn == 0


def test_sample_tokens_are_exactly_what_the_server_saw_and_sampled(server, pyfix, tok) -> None:
    scripted, base_url = server
    scripted.calls.clear()
    ((sample,),) = play(pyfix, base_url, "oracle", [2])
    turns = sample.episode.turns
    assert len(turns) == len(scripted.calls) == 5
    replies = oracle_replies(pyfix.tasks()[2].data)
    for turn, (prompt, reply), text in zip(turns, scripted.calls, replies, strict=True):
        start, end = turn.span
        assert prompt == sample.prompt_ids + sample.completion_ids[:start]
        assert (
            reply
            == sample.completion_ids[start:end]
            == [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
        )
        assert sample.completion_logprobs[start:end] == pytest.approx(
            [logprob(j) for j in range(end - start)]
        )
        assert all(sample.completion_mask[start:end])
    # Everything else (tool results, template markup) is context: mask 0, logprob 0.
    policy = {i for t in turns for i in range(*t.span)}
    assert all(m == (i in policy) for i, m in enumerate(sample.completion_mask))
    assert all(lp == 0.0 for i, lp in enumerate(sample.completion_logprobs) if i not in policy)
    # Per-turn records: the tools it called, their exit codes, timing.
    assert [[c.name for c in t.tool_calls] for t in turns] == [
        ["run_tests"],
        ["read_file"],
        ["edit_file"],
        ["run_tests"],
        [],
    ]
    assert [[r.exit_code for r in t.tool_results] for t in turns] == [[1], [None], [None], [0], []]
    assert all(t.model_s >= 0 and t.started_s >= 0 for t in turns)
    assert sample.episode.messages[turns[1].message_index + 1]["content"].startswith("1\tdef ")


def test_a_failed_model_call_is_an_error_sample_and_workspaces_are_removed(server, pyfix) -> None:
    (wrong_key,) = play(pyfix, server[1], "oracle", [0], api_key_var="PC_TEST_UNSET_VARIABLE")
    assert wrong_key[0].error is not None and "401" in wrong_key[0].error and wrong_key[0].reward == 0.0
    (unknown,) = play(pyfix, server[1], "no-such-agent", [0], group_size=2)
    assert all(s.error is not None and "404" in s.error for s in unknown)
    if IS_ROOT:  # every episode's workspace was deleted, failed ones included
        assert sorted(p.name for p in SANDBOX_ROOT.iterdir()) == [".uids"]


@pytest.mark.slow
def test_sft_records_are_the_oracle_episode(server, pyfix) -> None:
    records = envs.sft_records(pyfix, "train")
    assert len(records) == len(pyfix.tasks())
    ((sample,),) = play(pyfix, server[1], "oracle", [4])

    def without_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in m.items() if k != "tool_call_id"} for m in messages]

    assert without_ids(records[4]["messages"]) == without_ids(sample.episode.messages)
    assert records[4]["tools"] == sample.episode.tools


def hint_builder(tok: Any, **cfg: Any) -> HintBuilder:
    return HintBuilder(HintConfig(enabled=True, template_dir=HINTS_DIR, **cfg), tok, seq_len=8192)


@pytest.mark.parametrize(
    ("agent", "error_turn", "kind"), [("bad_edit", 0, "tool_error"), ("wrong_fix", 2, "failing_test")]
)
def test_sdpo_targets_the_turn_the_error_points_to(
    server, pyfix, tok, agent: str, error_turn: int, kind: str
) -> None:
    ((sample,),) = play(pyfix, server[1], agent, [0])
    assert sample.reward == 0.0 and sample.episode.error_turn == error_turn
    stats = asyncio.run(hint_builder(tok, sources=["feedback", "template"]).apply([sample]))
    assert stats.num_hinted == 1 and sdpo_target(sample).source == "feedback"
    turn = sample.episode.turns[error_turn]
    assert (
        sdpo_target(sample) is not None and sdpo_target(sample).span == turn.span
    )  # that turn's assistant tokens only
    # The teacher sees the conversation before that turn, then the hint, then the generation prompt.
    messages = sample.episode.messages
    feedback = next(f for f in sample.episode.feedback if f["turn"] == error_turn)
    assert feedback["kind"] == kind
    hint = {
        "role": "user",
        "content": f"Hint: Feedback on a previous attempt at this step:\n{feedback['text']}",
    }
    expected = tok.apply_chat_template(
        [*messages[: turn.message_index], hint],
        tokenize=False,
        add_generation_prompt=True,
        tools=sample.episode.tools,
    )
    assert tok.decode(sdpo_target(sample).teacher_prefix_ids) == expected
    # ... sharing the student's own tokens up to where the hint goes.
    student = sample.prompt_ids + sample.completion_ids[: turn.span[0]]
    shared = len(
        tok.apply_chat_template(messages[: turn.message_index], tokenize=False, tools=sample.episode.tools)
    )
    kept = max(k for k in range(len(student) + 1) if len(tok.decode(student[:k])) <= shared)
    assert sdpo_target(sample).teacher_prefix_ids[:kept] == student[:kept]


def test_sibling_hints_use_the_successful_siblings_reply_at_the_same_step(server, pyfix, tok) -> None:
    ((good,),), ((bad,),) = play(pyfix, server[1], "oracle", [0]), play(pyfix, server[1], "wrong_fix", [0])
    assert good.group_id == bad.group_id
    asyncio.run(hint_builder(tok, sources=["sibling"]).apply([good, bad]))
    assert sdpo_target(bad) is not None and sdpo_target(bad).span == bad.episode.turns[2].span
    assert (
        sdpo_target(bad).hint
        == "Hint: A correct answer to this task was:\n" + oracle_replies(pyfix.tasks()[0].data)[2]
    )


def test_an_episode_exports_to_the_replay_trace_store(server, pyfix) -> None:
    ((sample,),) = play(pyfix, server[1], "oracle", [1])
    # What the orchestrator posts to the teacher service: the episode as one trace, turn by turn.
    (sent,) = samples_to_traces([sample])
    assert sent == episode_trace([sample])
    trace = parse_trace(sent, "test", TraceSourceConfig())
    steps = [trace.turns[i] for i in trace.step_indices]
    assert len(steps) == 5
    assert [[c.name for c in s.tool_calls] for s in steps] == [
        ["run_tests"],
        ["read_file"],
        ["edit_file"],
        ["run_tests"],
        [],
    ]
    assert steps[4].content == "Fixed: the tests pass." and steps[0].content == ""
    for step, turn in zip(steps, sample.episode.turns, strict=True):
        start, end = turn.span
        assert step.token_ids == sample.completion_ids[start:end]
        assert step.prompt_token_ids == sample.prompt_ids + sample.completion_ids[:start]
        assert step.logprobs == pytest.approx(sample.completion_logprobs[start:end])
    tools = [t for t in trace.turns if t.role == "tool"]
    assert [t.exit_code for t in tools] == [1, None, None, 0] and not any(t.is_error for t in tools)
    assert trace.record.reward == 1.0 and {t["name"] for t in trace.record.tools} == {
        "run_tests",
        "read_file",
        "edit_file",
    }

"""The quickstart ``arith`` environment and loading environments by id (no server involved)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import verifiers.v1 as vf

from prime_composer.config.env import EnvConfig
from prime_composer.orchestrator import envs

ENV_DIRS = [Path(__file__).resolve().parents[2] / "environments"]


def load_env(entry: EnvConfig, index: int) -> envs.LoadedEnv:
    return envs.load_env(entry, index, env_dirs=ENV_DIRS)


@pytest.fixture(scope="module")
def arith() -> object:
    loaded = load_env(EnvConfig(id="arith", eval_args={"split": "eval"}), 0)
    import arith as module  # importable once load_env put the local folder on sys.path

    return loaded, module


def _pair(task: vf.Task) -> tuple[int, int]:
    return task.data.a, task.data.b


def test_splits_partition_all_pairs(arith) -> None:
    loaded, _ = arith
    train = {_pair(t) for t in loaded.tasks("train")}
    held_out = {_pair(t) for t in loaded.tasks("eval")}
    everything = {(a, b) for a in range(10) for b in range(10)}
    assert train | held_out == everything
    assert not train & held_out
    assert len(held_out) == math.ceil(0.2 * 100)


def test_task_prompt_and_answer(arith) -> None:
    loaded, _ = arith
    for task in loaded.tasks("train")[:5]:
        a, b = _pair(task)
        assert task.data.prompt == f"What is {a} + {b}?"
        assert task.data.answer == str(a + b)
    assert [t.data.idx for t in loaded.tasks("train")[:3]] == [0, 1, 2]


def _scored_trace(task: vf.Task, reply: str) -> vf.Trace:
    trace = vf.Trace(
        task=vf.TraceTask(type="ArithTask", data=task.data),
        agent=vf.AgentInfo(config=vf.AgentConfig(runtime=vf.SubprocessConfig())),
    )
    trace.root_reply = reply
    asyncio.run(task.score(trace))
    return trace


def _score(task: vf.Task, reply: str) -> tuple[float, dict]:
    trace = _scored_trace(task, reply)
    return trace.reward, dict(trace.metrics)


def test_reward_is_exact_match_of_the_number(arith) -> None:
    loaded, _ = arith
    task = loaded.tasks("train")[0]
    answer = str(task.data.a + task.data.b)
    assert _score(task, answer) == (1.0, {"is_integer": 1.0})
    assert _score(task, f"  {answer}\n") == (1.0, {"is_integer": 1.0})
    assert _score(task, str(int(answer) + 1)) == (0.0, {"is_integer": 1.0})
    assert _score(task, f"The answer is {answer}") == (0.0, {"is_integer": 0.0})


def test_wrong_replies_leave_feedback_without_the_answer(arith) -> None:
    loaded, _ = arith
    task = loaded.tasks("train")[0]
    a, b = _pair(task)
    assert "feedback" not in _scored_trace(task, str(a + b)).info
    wrong = _scored_trace(task, str(a + b + 1)).info["feedback"]
    assert wrong == {"text": f"{a + b + 1} is not {a} + {b}.", "kind": "wrong_answer"}
    garbled = _scored_trace(task, "seven").info["feedback"]
    assert garbled["kind"] == "wrong_format" and "'seven'" in garbled["text"]
    assert str(a + b) not in garbled["text"].replace(f"{a} + {b}", "")


def test_sft_examples_match_the_taskset(arith) -> None:
    loaded, module = arith
    pairs = list(module.sft_examples(module.ArithConfig(id="arith", split="eval")))
    assert pairs == envs.sft_pairs(loaded, "eval")
    messages, answer = pairs[0]
    assert messages[0]["role"] == "user" and messages[0]["content"].startswith("What is ")
    a, b = (int(x) for x in messages[0]["content"][len("What is ") : -1].split(" + "))
    assert answer == str(a + b)


def test_args_reach_the_taskset() -> None:
    loaded = load_env(
        EnvConfig(id="arith", args={"max_operand": 3, "num_tasks": 5}, eval_args={"split": "eval"}), 0
    )
    tasks = loaded.tasks()
    assert len(tasks) == 5 and all(t.data.a <= 3 and t.data.b <= 3 for t in tasks)
    assert len(loaded.tasks("eval")) == math.ceil(0.2 * 16)


def test_unknown_id_names_the_entry_and_lists_what_exists() -> None:
    with pytest.raises(ValueError) as info:
        envs.load_envs([EnvConfig(id="arith"), EnvConfig(id="no-such-env", name="x")], env_dirs=ENV_DIRS)
    message = str(info.value)
    assert "orchestrator.env[1].id = 'no-such-env'" in message
    assert "arith" in message
    assert "arith" in envs.list_environments(ENV_DIRS)


def test_bad_args_name_the_entry() -> None:
    with pytest.raises(ValueError, match=r"orchestrator\.env\[0\].*invalid args"):
        load_env(EnvConfig(id="arith", args={"max_operands": 3}), 0)


def test_duplicate_labels_are_rejected() -> None:
    with pytest.raises(ValueError, match="more than once"):
        envs.load_envs([EnvConfig(id="arith"), EnvConfig(id="arith")], env_dirs=ENV_DIRS)


def test_eval_split_requires_eval_args() -> None:
    loaded = load_env(EnvConfig(id="arith"), 2)
    with pytest.raises(ValueError, match=r"orchestrator\.env\[2\].*eval_args"):
        loaded.tasks("eval")

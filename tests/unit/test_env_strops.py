"""The ``strops`` environment: string transforms whose held-out split holds unseen strings."""

from __future__ import annotations

import asyncio
import functools
from collections import Counter
from pathlib import Path

import pytest
import verifiers.v1 as vf

from prime_composer.config.env import EnvConfig
from prime_composer.orchestrator import envs

ENV_DIRS = [Path(__file__).resolve().parents[2] / "environments"]


def load(args: dict | None = None, eval_args: dict | None = None) -> envs.LoadedEnv:
    entry = EnvConfig(id="strops", args=args or {}, eval_args={"split": "eval", **(eval_args or {})})
    return envs.load_env(entry, 0, env_dirs=ENV_DIRS)


def _expected(op: str, s: str) -> str:
    """The transforms written another way than the taskset's."""
    if op == "reverse":
        return "".join(s[i] for i in range(len(s) - 1, -1, -1))
    if op == "sort":
        counts = Counter(s)
        return "".join(c * counts[c] for c in "abcdefghijklmnopqrstuvwxyz")
    if op == "rotate":
        return "".join(s[(i + 1) % len(s)] for i in range(len(s)))
    assert op == "dedupe"
    out = ""
    for c in s:
        if c not in out:
            out += c
    return out


def _edit_distance(a: str, b: str) -> int:
    @functools.cache
    def d(i: int, j: int) -> int:
        if i == 0 or j == 0:
            return i + j
        return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))

    return d(len(a), len(b))


def _score(task: vf.Task, reply: str) -> tuple[float, dict]:
    trace = vf.Trace(
        task=vf.TraceTask(type="StropsTask", data=task.data),
        agent=vf.AgentInfo(config=vf.AgentConfig(runtime=vf.SubprocessConfig())),
    )
    trace.root_reply = reply
    asyncio.run(task.score(trace))
    return trace.reward, dict(trace.metrics)


def test_held_out_strings_are_never_trained_on() -> None:
    loaded = load()
    train = loaded.tasks("train")
    held_out = loaded.tasks("eval")
    train_strings = {t.data.letters for t in train}
    eval_strings = {t.data.letters for t in held_out}
    assert len(train_strings) == 500 and len(eval_strings) == 200
    assert not train_strings & eval_strings
    assert len(held_out) == 4 * 200 and len(train) == 4 * 500
    assert all(4 <= len(s) <= 10 and set(s) <= set("abcdef") for s in train_strings | eval_strings)
    assert {t.data.letters for t in load().tasks("eval")} == eval_strings  # the same draw every time


def test_prompts_and_answers() -> None:
    for task in load().tasks("train")[:40]:
        op, s = task.data.op, task.data.letters
        assert task.data.prompt == f"{op.capitalize()}: {' '.join(s)}"
        assert task.data.answer == " ".join(_expected(op, s))


def test_exact_reply_scores_one_and_a_near_miss_earns_partial_credit() -> None:
    task = next(t for t in load({"partial_credit": 0.5}).tasks("train") if t.data.op == "reverse")
    answer = task.data.answer
    assert _score(task, answer) == (1.0, {"exact": 1.0})
    assert _score(task, f" {answer}\n") == (1.0, {"exact": 1.0})
    letters = answer.split()
    wrong = " ".join(["z", *letters[1:]])  # one substitution
    reward, metrics = _score(task, wrong)
    assert metrics == {"exact": 0.0}
    assert reward == pytest.approx(0.5 * (1 - 1 / len(letters)))


@pytest.mark.parametrize(
    ("reply", "where"),
    [
        ("d a b c", "letter 2 should be b"),  # answer d b a c: the first departure is the 2nd letter
        ("d b a", "letter 4 should be c"),  # a correct prefix, one letter short
        ("d b a c e", "it should end after 4 letters"),  # the whole answer, then more
        ("", "letter 1 should be d"),
    ],
)
def test_feedback_names_the_transform_and_the_first_wrong_letter(reply: str, where: str) -> None:
    task = next(t for t in load().tasks("train") if t.data.op == "reverse")
    task.data = task.data.model_copy(update={"letters": "cabd", "answer": "d b a c"})
    trace = vf.Trace(
        task=vf.TraceTask(type="StropsTask", data=task.data),
        agent=vf.AgentInfo(config=vf.AgentConfig(runtime=vf.SubprocessConfig())),
    )
    trace.root_reply = reply
    asyncio.run(task.score(trace))
    assert trace.info["feedback"] == {
        "text": f"{reply!r} is not reverse of c a b d: {where}.",
        "kind": "wrong_answer",
    }


def test_held_out_reward_is_exact_match_when_partial_credit_is_off() -> None:
    loaded = load({"partial_credit": 0.5}, {"partial_credit": 0.0})
    task = loaded.tasks("eval")[0]
    near = " ".join(task.data.answer.split()[:-1])
    assert _score(task, near) == (0.0, {"exact": 0.0})


@pytest.mark.parametrize(
    ("reply", "answer"), [("abc", "abc"), ("abc", "acb"), ("", "ab"), ("abcdef", "fedcba"), ("aab", "b")]
)
def test_similarity_is_one_minus_normalized_edit_distance(reply: str, answer: str) -> None:
    import strops  # importable once load() put the folder on sys.path

    load()
    expected = 1 - _edit_distance(reply, answer) / max(len(reply), len(answer))
    assert strops.similarity(" ".join(reply), " ".join(answer)) == pytest.approx(expected)


def test_sft_pairs_are_the_answers() -> None:
    loaded = load()
    pairs = envs.sft_pairs(loaded, "train")
    assert len(pairs) == 2000
    messages, answer = pairs[0]
    op, letters = messages[-1]["content"].split(": ")
    assert answer == " ".join(_expected(op.lower(), "".join(letters.split())))


def test_too_many_strings_for_the_alphabet_is_refused() -> None:
    with pytest.raises(ValueError, match="distinct strings"):
        load({"alphabet_size": 2, "min_len": 1, "max_len": 3})

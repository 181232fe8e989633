"""String transforms over a small alphabet; the held-out split holds strings never trained on.

A task where held-out accuracy can move: ``Reverse: c a b d`` -> ``d b a c``. Each task applies
one operation to one string of ``min_len``..``max_len`` letters drawn from the first
``alphabet_size`` letters; letters are written space-separated so that every letter is its own
token whatever the tokenizer merges. The operations:

- ``reverse``: the letters in reverse order;
- ``sort``: the letters in alphabetical order;
- ``rotate``: the first letter moved to the end;
- ``dedupe``: each letter's first occurrence only, in order.

The strings are drawn once from ``split_seed`` (distinct strings, no string in both splits), so a
model that only memorizes its training strings scores ~0 on ``eval``: the held-out accuracy
measures the rule, not the data.

The reward is 1 for an exact reply; otherwise ``partial_credit`` times the reply's similarity to
the answer (one minus the letter-level edit distance over the longer length), which gives RL a
gradient before the first exact reply. Set ``partial_credit = 0`` for the held-out split so that
its mean reward is exact-match accuracy. The metric ``exact`` is exact match in both cases.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from typing import Literal

import verifiers.v1 as vf
from pydantic import Field, model_validator

Operation = Literal["reverse", "sort", "rotate", "dedupe"]


def _dedupe(letters: str) -> str:
    return "".join(dict.fromkeys(letters))


OPERATIONS: dict[str, Callable[[str], str]] = {
    "reverse": lambda s: s[::-1],
    "sort": lambda s: "".join(sorted(s)),
    "rotate": lambda s: s[1:] + s[:1],
    "dedupe": _dedupe,
}
"""Operation name -> the transform of an unspaced string of letters."""

_LABELS = {"reverse": "Reverse", "sort": "Sort", "rotate": "Rotate", "dedupe": "Dedupe"}


def transform(op: str, letters: str) -> str:
    """``op`` applied to ``letters`` (unspaced)."""
    return OPERATIONS[op](letters)


def spaced(letters: str) -> str:
    return " ".join(letters)


def unspaced(reply: str) -> str:
    return "".join(reply.split())


def similarity(reply: str, answer: str) -> float:
    """1 - Levenshtein distance / max length, over letters (spaces ignored); 1.0 iff equal."""
    a, b = unspaced(reply), unspaced(answer)
    if not a and not b:
        return 1.0
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return 1.0 - previous[-1] / max(len(a), len(b))


def feedback_text(reply: str, op: str, letters: str) -> str:
    """What went wrong in ``reply`` (the environment's feedback, SDPO's ``feedback`` hint): the
    transform it missed and the first position where it departs from the answer, with the letter
    that belongs there, e.g. ``'d a b c' is not reverse of c a b d: letter 2 should be b.``"""
    got, want = unspaced(reply), transform(op, letters)
    first = next(
        (i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w), min(len(got), len(want))
    )
    if first < len(want):
        where = f"letter {first + 1} should be {want[first]}"
    else:
        where = f"it should end after {len(want)} letters"
    return f"{reply[:40]!r} is not {op} of {spaced(letters)}: {where}."


class StropsData(vf.TaskData):
    """One transform: the operation, the input letters (unspaced) and the spaced answer."""

    op: str
    letters: str
    answer: str


class StropsTask(vf.Task[StropsData]):
    """Exact match scores 1; a near miss earns ``partial_credit`` times its similarity."""

    partial_credit: float = 0.0

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        reply = trace.last_reply.strip()
        if reply == self.data.answer:
            return 1.0
        trace.info["feedback"] = {
            "text": feedback_text(reply, self.data.op, self.data.letters),
            "kind": "wrong_answer",
        }
        return self.partial_credit * similarity(reply, self.data.answer)

    @vf.metric
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)


class StropsConfig(vf.TasksetConfig):
    """Which transforms the taskset yields."""

    split: Literal["train", "eval"] = "train"
    """``train`` or the held-out ``eval`` strings."""
    operations: list[Operation] = Field(default_factory=lambda: ["reverse", "sort", "rotate", "dedupe"])
    """The operations to draw tasks from (every string gets every operation)."""
    alphabet_size: int = Field(6, ge=2, le=26)
    """Letters ``a``, ``b``, ... used."""
    min_len: int = Field(4, ge=1)
    max_len: int = Field(10, ge=1)
    num_train_strings: int = Field(500, ge=1)
    """Distinct strings in ``train`` (times the operations = tasks)."""
    num_eval_strings: int = Field(200, ge=1)
    """Distinct strings in ``eval``, none of them in ``train``."""
    split_seed: int = 0
    """Seed of the draw (keep it fixed across SFT, RL and eval)."""
    partial_credit: float = Field(0.0, ge=0.0, le=1.0)
    """Reward of a wrong reply per unit of similarity; 0 makes the reward exact match."""

    @model_validator(mode="after")
    def _check(self) -> StropsConfig:
        if self.max_len < self.min_len:
            raise ValueError(f"strops: max_len ({self.max_len}) < min_len ({self.min_len})")
        if not self.operations:
            raise ValueError(
                "strops: operations is empty; name at least one of reverse, sort, rotate, dedupe"
            )
        possible = sum(self.alphabet_size**n for n in range(self.min_len, self.max_len + 1))
        wanted = self.num_train_strings + self.num_eval_strings
        if wanted > possible // 2:
            raise ValueError(
                f"strops: {wanted} distinct strings asked of {possible} possible; lower "
                "num_train_strings/num_eval_strings or raise alphabet_size/max_len"
            )
        return self


def _draw_strings(config: StropsConfig) -> list[str]:
    rng = random.Random(config.split_seed)
    letters = string.ascii_lowercase[: config.alphabet_size]
    wanted = config.num_train_strings + config.num_eval_strings
    seen: dict[str, None] = {}
    while len(seen) < wanted:
        n = rng.randint(config.min_len, config.max_len)
        seen.setdefault("".join(rng.choice(letters) for _ in range(n)), None)
    return list(seen)


def split_tasks(config: StropsConfig) -> list[tuple[str, str]]:
    """(operation, letters) of ``config.split``: every operation on every string of the split."""
    drawn = _draw_strings(config)
    strings = (
        drawn[config.num_train_strings :] if config.split == "eval" else drawn[: config.num_train_strings]
    )
    return [(op, s) for s in strings for op in config.operations]


def prompt_text(op: str, letters: str) -> str:
    return f"{_LABELS[op]}: {spaced(letters)}"


class StropsTaskset(vf.Taskset[StropsTask, StropsConfig]):
    """Every configured operation on every string of the split, one task each."""

    def load(self) -> list[StropsTask]:
        tasks = []
        for op, letters in split_tasks(self.config):
            task = StropsTask(
                StropsData(
                    id=f"{op}:{letters}",
                    prompt=prompt_text(op, letters),
                    op=op,
                    letters=letters,
                    answer=spaced(transform(op, letters)),
                ),
                self.config.task,
            )
            task.partial_credit = self.config.partial_credit
            tasks.append(task)
        return tasks

"""Sums of two small numbers; the reply must be just the number.

A task small enough that a 450k-parameter model learns it from a short SFT warm-up and then
improves under RL: the prompt is ``What is 3 + 4?`` and the reward is 1 when the whole reply
(whitespace stripped) is the correct integer, else 0. Every ordered pair of operands in
``[min_operand, max_operand]`` is a task; a fixed, seeded shuffle puts ``eval_fraction`` of the
pairs in a held-out ``eval`` split that the ``train`` split never contains.

A wrong reply also leaves environment feedback on ``trace.info["feedback"]`` (what a failing
check would print), which SDPO's ``feedback`` hint source turns into a hint.

``sft_examples`` yields the same prompts with their reference answers for supervised warm-up.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterator
from typing import Literal

import verifiers.v1 as vf
from pydantic import Field, model_validator

_INTEGER = re.compile(r"-?\d+")


class ArithData(vf.TaskData):
    """One sum: its operands and the reference answer (the decimal string of their sum)."""

    a: int
    b: int
    answer: str


class ArithTask(vf.Task[ArithData]):
    """Scores a rollout by exact match of the reply with the reference answer."""

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        reply = trace.last_reply.strip()
        if reply == self.data.answer:
            return 1.0
        trace.info["feedback"] = feedback(reply, self.data)
        return 0.0

    @vf.metric
    async def is_integer(self, trace: vf.Trace) -> float:
        """Whether the reply is an integer at all (format learned, value possibly wrong)."""
        return float(_INTEGER.fullmatch(trace.last_reply.strip()) is not None)


class ArithConfig(vf.TasksetConfig):
    """Which sums the taskset yields."""

    split: Literal["train", "eval"] = "train"
    """``train`` or the held-out ``eval`` pairs."""
    min_operand: int = Field(0, ge=0)
    """Smallest operand."""
    max_operand: int = Field(9, ge=0)
    """Largest operand."""
    eval_fraction: float = Field(0.2, ge=0, lt=1)
    """Share of operand pairs held out for the ``eval`` split."""
    split_seed: int = 0
    """Seed of the shuffle that assigns pairs to splits (keep it fixed across SFT, RL and eval)."""
    num_tasks: int | None = Field(None, ge=1)
    """Yield only the first this-many tasks of the split; ``None`` yields all."""

    @model_validator(mode="after")
    def _check_range(self) -> ArithConfig:
        if self.max_operand < self.min_operand:
            raise ValueError(f"arith: max_operand ({self.max_operand}) < min_operand ({self.min_operand})")
        return self


def feedback(reply: str, data: ArithData) -> dict[str, str]:
    """What the checker reports about a wrong reply (it never states the right answer)."""
    shown = reply if len(reply) <= 40 else reply[:40] + "..."
    if _INTEGER.fullmatch(reply) is None:
        return {
            "text": f"The reply {shown!r} is not a number; reply with only the number.",
            "kind": "wrong_format",
        }
    return {"text": f"{reply} is not {data.a} + {data.b}.", "kind": "wrong_answer"}


def prompt_text(a: int, b: int) -> str:
    """The user message of the sum ``a + b``."""
    return f"What is {a} + {b}?"


def split_pairs(config: ArithConfig) -> list[tuple[int, int]]:
    """The operand pairs of ``config.split``, in a fixed shuffled order."""
    operands = range(config.min_operand, config.max_operand + 1)
    pairs = [(a, b) for a in operands for b in operands]
    random.Random(config.split_seed).shuffle(pairs)
    num_eval = math.ceil(config.eval_fraction * len(pairs))
    chosen = pairs[:num_eval] if config.split == "eval" else pairs[num_eval:]
    return chosen if config.num_tasks is None else chosen[: config.num_tasks]


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    """All sums of the configured split, one task each."""

    def load(self) -> list[ArithTask]:
        return [
            ArithTask(
                ArithData(
                    id=f"{a}+{b}",
                    prompt=prompt_text(a, b),
                    a=a,
                    b=b,
                    answer=str(a + b),
                ),
                self.config.task,
            )
            for a, b in split_pairs(self.config)
        ]


def sft_examples(config: ArithConfig | None = None) -> Iterator[tuple[list[dict[str, str]], str]]:
    """(prompt messages, reference answer) pairs of ``config``'s split, for SFT warm-up.

    The messages are chat-template dicts (``[{"role": "user", "content": ...}]``); the answer is
    what the assistant turn should contain.
    """
    config = config or ArithConfig(id="arith")
    for a, b in split_pairs(config):
        yield [{"role": "user", "content": prompt_text(a, b)}], str(a + b)

"""Hint-aware SFT warm-up data for strops: chats in which part of the tasks carry SDPO's hint.

SDPO's teacher is the policy shown a hint. A model warmed up only on ``[user: task] -> answer``
never saw a hint message and reads it worse than nothing (docs/experiments.md, 2026-12-02: "why
SDPO hurts on strops"). This writes warm-up chats for ``[warmup] data`` in which a fraction of the
tasks carry, right before the answer, the hint message exactly as ``orchestrator.sdpo`` renders it
(``HintConfig`` defaults: ``hint_format``, ``hint_role``, ``placement = "message"``):

- ``sibling``: ``Hint: A correct answer to this task was:\\n<answer>`` (``sibling_format``);
- ``feedback``: ``Hint: Feedback on a previous attempt at this step:\\n'<wrong>' is not <op> of
  <letters>: letter <i> should be <x>.`` (``feedback_format`` around the strops environment's own
  feedback text, ``feedback_text``), the wrong reply being the answer with two letters swapped or
  one changed.

The rest are plain chats. Only train-split strings are used (never the held-out ones).

    uv run python bench/ablation_hinted_warmup.py --out outputs/strops-hinted/warmup.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "environments" / "strops"))

from strops.taskset import StropsConfig, feedback_text, prompt_text, spaced, split_tasks, transform

from prime_composer.config.sdpo import HintConfig
from prime_composer.io import atomic_write_text


def wrong_reply(rng: random.Random, answer: str, alphabet: str) -> str:
    """A near miss of ``answer`` (spaced letters): two letters swapped, else one letter changed."""
    letters = answer.split()
    i, j = sorted(rng.sample(range(len(letters)), 2))
    if letters[i] != letters[j] and rng.random() < 0.5:
        letters[i], letters[j] = letters[j], letters[i]
    else:
        letters[i] = rng.choice([c for c in alphabet if c != letters[i]])
    return " ".join(letters)


def hint_message(cfg: HintConfig, source: str, body: str) -> dict[str, Any]:
    inner = cfg.sibling_format if source == "sibling" else cfg.feedback_format
    key = "{solution}" if source == "sibling" else "{feedback}"
    return {"role": cfg.hint_role, "content": cfg.hint_format.replace("{hint}", inner.replace(key, body))}


def hinted_chats(
    env: StropsConfig, cfg: HintConfig, num_examples: int, sibling: float, feedback: float, seed: int
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """``num_examples`` chats over the train tasks (a seeded order, cycled) and their counts by kind."""
    if env.split != "train":
        raise ValueError("hinted warm-up data is built from the train split only")
    if sibling < 0 or feedback < 0 or sibling + feedback > 1:
        raise ValueError(f"--sibling {sibling} + --feedback {feedback}: each >= 0, together <= 1")
    rng = random.Random(seed)
    tasks = split_tasks(env)
    alphabet = "abcdefghijklmnopqrstuvwxyz"[: env.alphabet_size]
    chats: list[dict[str, Any]] = []
    counts = {"plain": 0, "sibling": 0, "feedback": 0}
    while len(chats) < num_examples:
        order = list(range(len(tasks)))
        rng.shuffle(order)
        for k in order[: num_examples - len(chats)]:
            op, letters = tasks[k]
            answer = spaced(transform(op, letters))
            messages: list[dict[str, Any]] = [{"role": "user", "content": prompt_text(op, letters)}]
            u = rng.random()
            if u < sibling:
                kind = "sibling"
                messages.append(hint_message(cfg, "sibling", answer))
            elif u < sibling + feedback and len(answer.split()) >= 2:
                kind = "feedback"
                reply = wrong_reply(rng, answer, alphabet)
                messages.append(hint_message(cfg, "feedback", feedback_text(reply, op, letters)))
            else:
                kind = "plain"
            messages.append({"role": "assistant", "content": answer})
            counts[kind] += 1
            chats.append({"messages": messages})
    return chats, counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--num-examples", type=int, default=2000)
    p.add_argument("--sibling", type=float, default=0.25, help="fraction with a sibling hint")
    p.add_argument("--feedback", type=float, default=0.25, help="fraction with a feedback hint")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    env = StropsConfig(split="train", operations=["reverse", "rotate"], alphabet_size=6, min_len=4, max_len=8)
    chats, counts = hinted_chats(
        env, HintConfig(enabled=True), args.num_examples, args.sibling, args.feedback, args.seed
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, "".join(json.dumps(c) + "\n" for c in chats))
    print(f"wrote {len(chats)} chats to {args.out}: {counts}")


if __name__ == "__main__":
    main()

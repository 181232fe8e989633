"""bench/ablation_hinted_warmup.py: its hinted chats render to the very context SDPO's teacher sees.

The warm-up teaches the model to read a hint only if the hint it trains on is the one the real
``HintBuilder`` inserts. Each hinted chat's prompt (all messages but the answer) is compared, as
tokens, with ``sdpo_target(...).teacher_prefix_ids`` that ``HintBuilder.apply`` builds for a failed
rollout of the same task: with a successful sibling (sibling hint), and alone with the strops
environment's feedback (feedback hint).
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from prime_composer.config.sdpo import HintConfig
from prime_composer.model.resolve import resolve_model_name
from prime_composer.orchestrator.record import EpisodeRecord
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.sdpo.hints import HintBuilder
from prime_composer.orchestrator.sdpo.target import sdpo_target

BENCH = Path(__file__).resolve().parents[2] / "bench" / "ablation_hinted_warmup.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("ablation_hinted_warmup", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _env(bench, split: str = "train"):
    from strops.taskset import StropsConfig  # on sys.path once the bench is loaded

    return StropsConfig(split=split, operations=["reverse", "rotate"], alphabet_size=6, min_len=4, max_len=8)


def _render(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def _sample(tok, prompt: str, reply: str, reward: float, group: int, feedback: dict | None) -> Sample:
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]
    ids = _render(tok, messages[:1])
    comp = [*tok.encode(reply, add_special_tokens=False), tok.convert_tokens_to_ids("<|im_end|>")]
    return Sample(
        prompt_ids=ids,
        completion_ids=comp,
        completion_logprobs=[0.0] * len(comp),
        completion_mask=[1] * len(comp),
        reward=reward,
        example_id=group,
        group_id=group,
        policy_step=0,
        episode=EpisodeRecord(task={"prompt": prompt}, messages=messages, feedback=feedback),
    )


def test_hinted_chats_match_the_hint_builders_teacher_context(bench) -> None:
    tok = AutoTokenizer.from_pretrained(resolve_model_name("builtin:tiny-qwen3"))
    cfg = HintConfig(enabled=True, sources=["sibling", "feedback"], max_hinted_fraction=1.0)
    chats, counts = bench.hinted_chats(_env(bench), cfg, 200, 0.25, 0.25, seed=3)
    assert len(chats) == 200 and sum(counts.values()) == 200
    assert counts["sibling"] > 20 and counts["feedback"] > 20 and counts["plain"] > 60
    checked = {"sibling": 0, "feedback": 0}
    for group, chat in enumerate(chats[:40]):
        messages = chat["messages"]
        if len(messages) == 2:
            continue
        task, hint, answer = messages
        assert hint["content"].startswith("Hint: ")
        if "correct answer" in hint["content"]:
            kind = "sibling"
            samples = [
                _sample(tok, task["content"], answer["content"], 1.0, group, None),
                _sample(tok, task["content"], "a b", 0.1, group, {"text": "x", "kind": "wrong_answer"}),
            ]
        else:
            kind = "feedback"
            text = hint["content"].split("\n", 1)[1]
            wrong = text.split("'")[1]
            assert wrong != answer["content"] and len(wrong) == len(answer["content"])
            samples = [
                _sample(tok, task["content"], wrong, 0.1, group, {"text": text, "kind": "wrong_answer"})
            ]
        builder = HintBuilder(cfg, tok, 160)  # configs/strops-hinted.toml's seq_len
        assert asyncio.run(builder.apply(samples)).num_hinted == 1
        target = sdpo_target(samples[-1])
        assert target is not None and target.source == kind
        assert target.teacher_prefix_ids == _render(tok, [task, hint]), kind
        checked[kind] += 1
    assert checked["sibling"] >= 3 and checked["feedback"] >= 3


def test_hinted_chats_use_train_strings_only(bench) -> None:
    from strops.taskset import prompt_text, split_tasks

    cfg = HintConfig(enabled=True)
    chats, _ = bench.hinted_chats(_env(bench), cfg, 1500, 0.3, 0.3, seed=0)
    held_out = {prompt_text(op, s) for op, s in split_tasks(_env(bench, "eval"))}
    prompts = {c["messages"][0]["content"] for c in chats}
    assert len(prompts) == 1000 and not prompts & held_out  # every train task once, none held out
    with pytest.raises(ValueError, match="train split"):
        bench.hinted_chats(_env(bench, "eval"), cfg, 10, 0.25, 0.25, seed=0)
    with pytest.raises(ValueError, match="together <= 1"):
        bench.hinted_chats(_env(bench), cfg, 10, 0.7, 0.5, seed=0)

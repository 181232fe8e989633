"""SDPO on the tiny model: the hinted teacher knows the answer; SDPO alone teaches it to the student.

1. Warm-up (SFT, inside the test): half the chats are ``[user: What is a + b?] [user: Hint: The
   correct answer is X.] -> assistant: X`` with X one of four two-digit numbers unrelated to the
   question (so X can only come from the hint), half have no hint and another random two-digit
   answer. (Copying an arbitrary number out of the hint takes this 2-layer model far more steps than
   a unit test can afford; telling four hinted answers apart takes ~60 steps on some CPUs and ~90 on
   others, so the warm-up takes 90.)
2. A failed rollout of one fixed question gets a hint from the real ``HintBuilder`` (the shipped
   ``wrong_answer`` template, with the task's answer X*). The teacher (the warmed-up model, frozen)
   scores the answer tokens after the hinted context, the student after the plain one: the teacher
   gives them more probability.
3. A few optimizer steps on ``sdpo_loss`` alone (no reward, no RL term) raise the student's
   probability of X* *without* the hint.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from prime_composer.config.loss import SDPOLossConfig
from prime_composer.config.sdpo import HintConfig
from prime_composer.model.resolve import resolve_model_name
from prime_composer.orchestrator.record import EpisodeRecord
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.sdpo.hints import HintBuilder
from prime_composer.orchestrator.sdpo.target import sdpo_target
from prime_composer.trainer.losses.aggregate import token_normalizer
from prime_composer.trainer.losses.sdpo import sdpo_loss
from prime_composer.trainer.policy_copy import PolicyCopy

HINTS_DIR = Path(__file__).resolve().parents[2] / "hints"
TARGET = "58"
HINTED = [TARGET, "13", "72", "36"]
UNHINTED = [str(i) for i in range(10, 100) if str(i) not in HINTED]


def _render(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def _question(a: int, b: int) -> dict[str, str]:
    return {"role": "user", "content": f"What is {a} + {b}?"}


def _hint(x: str) -> dict[str, str]:
    # What the shipped wrong_answer template + the default hint_format produce.
    return {"role": "user", "content": f"Hint: The correct answer is {x}."}


def _answer_ids(tok, x: str) -> list[int]:
    return [*tok.encode(x, add_special_tokens=False), tok.eos_token_id]


def _warm_up(model, tok, num_steps: int = 90, batch_size: int = 32) -> None:
    rng = random.Random(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(num_steps):
        rows, masks = [], []
        for i in range(batch_size):
            question = _question(rng.randint(0, 9), rng.randint(0, 9))
            if i % 2:
                x = rng.choice(HINTED)
                prompt = _render(tok, [question, _hint(x)])
            else:
                x = rng.choice(UNHINTED)
                prompt = _render(tok, [question])
            answer = _answer_ids(tok, x)
            rows.append(prompt + answer)
            masks.append([0] * len(prompt) + [1] * len(answer))
        width = max(len(r) for r in rows)  # right padding, outside the loss mask
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.bool)
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits[mask[:, 1:]], ids[:, 1:][mask[:, 1:]])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def _answer_logprob(model, context: list[int], answer: list[int]) -> float:
    ids = torch.tensor([context + answer])
    with torch.no_grad():
        logp = model(input_ids=ids, use_cache=False).logits[0, len(context) - 1 : -1].log_softmax(-1)
    return float(logp.gather(1, torch.tensor(answer)[:, None]).sum())


@pytest.fixture(scope="module")
def warmed():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    path = resolve_model_name("builtin:tiny-qwen3")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    _warm_up(model, tok)
    return model, tok


@pytest.mark.slow
def test_warm_up_taught_the_model_to_read_hints(warmed):
    model, tok = warmed
    for x in ("13", "72"):  # the hint decides between the hinted answers
        right = _answer_logprob(model, _render(tok, [_question(2, 5), _hint(x)]), _answer_ids(tok, x))
        wrong = _answer_logprob(model, _render(tok, [_question(2, 5), _hint(x)]), _answer_ids(tok, "36"))
        assert right > wrong + 1.0, (x, right, wrong)


@pytest.mark.slow
def test_teacher_beats_student_and_sdpo_steps_raise_the_student(warmed):
    model, tok = warmed
    model = type(model)(model.config)
    model.load_state_dict(warmed[0].state_dict())  # a private copy: the fixture stays as it was
    # A failed rollout "What is 3 + 4?" -> "58" whose task says the answer is 58.
    messages = [_question(3, 4), {"role": "assistant", "content": TARGET}]
    prompt = _render(tok, messages[:1])
    answer = _answer_ids(tok, TARGET)
    sample = Sample(
        prompt_ids=prompt,
        completion_ids=answer,
        completion_logprobs=[0.0] * len(answer),
        completion_mask=[1] * len(answer),
        reward=0.0,
        example_id=0,
        group_id=0,
        policy_step=0,
        episode=EpisodeRecord(messages=messages, task={"answer": TARGET}),
    )
    builder = HintBuilder(HintConfig(enabled=True, sources=["template"], template_dir=HINTS_DIR), tok, 128)
    assert asyncio.run(builder.apply([sample])).num_hinted == 1
    assert sdpo_target(sample).teacher_prefix_ids == _render(tok, [_question(3, 4), _hint(TARGET)])
    start, end = sdpo_target(sample).span

    teacher = PolicyCopy(model, "frozen")
    teacher_lp = _answer_logprob(teacher.module, sdpo_target(sample).teacher_prefix_ids, answer[start:end])
    student_before = _answer_logprob(model, prompt, answer)
    assert teacher_lp > student_before + 2.0, (teacher_lp, student_before)

    # SDPO only: student rows = prompt + answer; teacher rows = hinted prefix + the same answer.
    student_ids = torch.tensor([prompt + answer])
    sdpo_mask = torch.zeros_like(student_ids, dtype=torch.bool)
    sdpo_mask[0, len(prompt) + start : len(prompt) + end] = True
    teacher_ids = torch.tensor([sdpo_target(sample).teacher_prefix_ids + answer[start:end]])
    teacher_mask = torch.zeros_like(teacher_ids, dtype=torch.bool)
    teacher_mask[0, len(sdpo_target(sample).teacher_prefix_ids) :] = True
    cfg = SDPOLossConfig(weight=1.0, teacher="frozen")
    normalizer = token_normalizer([sdpo_mask])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    losses = []
    for _ in range(8):
        target = teacher.target_logits(
            teacher_ids, torch.arange(teacher_ids.shape[1])[None], teacher_mask, 1.0
        )
        logits = model(input_ids=student_ids, use_cache=False).logits
        student = logits[:, :-1][sdpo_mask[:, 1:]]  # the position before each target predicts it
        loss, _ = sdpo_loss(
            student, target, torch.ones(student.shape[0], dtype=torch.bool), cfg, 1.0, normalizer
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    student_after = _answer_logprob(model, prompt, answer)
    assert losses[-1] < losses[0]
    assert student_after > student_before + 1.0, (student_before, student_after)
    assert teacher.num_forwards == 8
    # The frozen teacher did not move.
    assert _answer_logprob(
        teacher.module, sdpo_target(sample).teacher_prefix_ids, answer[start:end]
    ) == pytest.approx(teacher_lp)

"""Pair tokens and reference logprobs (tiny model, CPU), and the pair store's cursor contract.

The batched, right-padded reference forward is checked against a plain forward of each sequence
alone; the context against the tokenizer's own ``apply_chat_template(tokenize=True)``.
"""

from __future__ import annotations

import pytest
import torch

from prime_composer.config.base import ModelConfig
from prime_composer.config.teacher import ReferenceConfig
from prime_composer.model.resolve import resolve_model_name
from prime_composer.teacher.pairs import PairStore
from prime_composer.teacher.reference import ReferenceScorer
from prime_composer.teacher.replay import reference_pass
from prime_composer.teacher.store import PairCandidate, PlannedStep, TeacherStore
from prime_composer.teacher.traces import TraceSourceConfig, parse_trace

MODEL = "builtin:tiny-qwen3"


@pytest.fixture(scope="module")
def scorer():
    torch.set_num_threads(1)
    return ReferenceScorer(ModelConfig(name=MODEL), ReferenceConfig(batch_size=3))


@pytest.fixture(scope="module")
def plain_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve_model_name(MODEL), dtype=torch.float32).eval()


def alone(model, context, completion) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([context + completion])).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return [logprobs[len(context) - 1 + i, t].item() for i, t in enumerate(completion)]


def test_batched_reference_logprobs_equal_each_sequence_alone(scorer, plain_model):
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    context = scorer.context_ids(messages)
    expected_context = scorer.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    expected_context = (
        expected_context["input_ids"] if hasattr(expected_context, "keys") else expected_context
    )
    assert context == list(expected_context)
    completions = [
        scorer.completion_ids(t) for t in ("5", "The answer is 5.", "def f():\n    return 5", "x" * 40)
    ]
    assert all(c[-1] == scorer.tokenizer.eos_token_id for c in completions)
    sequences = [(context, c) for c in completions] + [(context[:3], completions[1])]
    scores = scorer.score(sequences)  # 5 sequences in batches of 3: padding in both batches
    for (ctx, comp), got in zip(sequences, scores, strict=True):
        assert got == pytest.approx(alone(plain_model, ctx, comp), abs=1e-4)


def candidate(trace_id: str, turn: int, chosen: str, rejected: str, **extra) -> PairCandidate:
    fields = dict(
        trace_id=trace_id,
        turn_index=turn,
        state_hash=f"{trace_id}-{turn}",
        chosen_key=chosen,
        rejected_key=rejected,
        context_messages=[{"role": "user", "content": "Fix calc.py"}],
        chosen_text=chosen,
        rejected_text=rejected,
        context_ids=None,
        chosen_ids=None,
        rejected_ids=None,
        chosen_source="teacher",
        label_smoothing=0.0,
        vote_share=1.0,
        margin=1.0,
        process_reward=-1.0,
        provenance={"teachers": ["a"]},
    )
    fields.update(extra)
    return PairCandidate(**fields)


def store_with_pairs(tmp_path, pairs: list[PairCandidate]) -> TeacherStore:
    store = TeacherStore(tmp_path / "teacher.sqlite")
    trace = parse_trace(
        {"id": "t", "turns": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
        "s",
        TraceSourceConfig(),
    )
    store.add_trace(trace)
    for k, pair in enumerate(pairs):
        store.save_plan("t", [PlannedStep(k, pair.state_hash, {}, 1.0, 0.0, True)])
        store.finish_step("t", k, status="done", outcome="pair", process_reward=-1.0, trace_share=0.0, best_share=1.0,
                          num_votes=2, votes=[], cost_usd=0.0, pair=pair)  # fmt: skip
    return store


def test_reference_pass_makes_pairs_ready_in_cursor_order(tmp_path, scorer, plain_model):
    exact = candidate("t", 1, "ls", "cat", context_ids=[1, 2, 3, 4], rejected_ids=[9, 8])  # trace tokens
    store = store_with_pairs(
        tmp_path,
        [candidate("t", 0, "run pytest", "rm -rf tests"), exact, candidate("t", 2, "x " * 3000, "y")],
    )
    assert reference_pass(store, scorer, max_pair_tokens=512, batch=2) == 2
    pairs = PairStore(store.path)
    ready = pairs.take(10)
    assert [p.cursor for p in ready] == [1, 2] and [p.turn_index for p in ready] == [0, 1]
    first, second = ready
    assert first.context_ids == scorer.context_ids([{"role": "user", "content": "Fix calc.py"}])
    assert first.chosen_ids == scorer.completion_ids("run pytest")
    assert first.ref_chosen_logprobs == pytest.approx(
        alone(plain_model, first.context_ids, first.chosen_ids), abs=1e-4
    )
    assert first.ref_rejected_logp == pytest.approx(
        sum(alone(plain_model, first.context_ids, first.rejected_ids)), abs=1e-3
    )
    # The trace's own tokens are used as they are (the end token appended).
    assert second.context_ids == [1, 2, 3, 4] and second.rejected_ids == [9, 8, scorer.tokenizer.eos_token_id]
    assert len(second.ref_rejected_logprobs) == 3
    # The third is longer than max_pair_tokens: recorded, never handed out.
    status = next(p for p in store.pairs() if p["turn_index"] == 2)
    assert status["status"] == "too_long" and "max_pair_tokens = 512" in status["status_reason"]
    assert (
        pairs.take(10, after_cursor=1) == [second]
        and pairs.latest_cursor() == 2
        and pairs.count(after_cursor=0) == 2
    )
    assert pairs.process_rewards("t") == {0: -1.0, 1: -1.0, 2: -1.0}
    # A second pass finds nothing to do and changes no cursor.
    assert reference_pass(store, scorer, max_pair_tokens=512) == 0 and pairs.take(10) == ready


def test_pair_store_before_the_service_created_it(tmp_path):
    pairs = PairStore(tmp_path / "missing.sqlite")
    assert pairs.take(5) == [] and pairs.latest_cursor() == 0 and pairs.count() == 0
    with pytest.raises(ValueError, match="at least 1"):
        pairs.take(0)

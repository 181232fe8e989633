"""SDPO in the trainer step: no teacher forward at weight 0, gradients only through the student.

The reference gradient is computed without the code under test: plain unpacked float64 forwards of the
model on each student and teacher sequence, the teacher's distribution detached, and the forward
KL ``sum_t KL(P_teacher || P_student)`` written out with ``log_softmax`` (beta = 0), times alpha,
over the step's number of target tokens. The RL term has zero advantages, so it adds no gradient.
If the teacher pass leaked gradient into the shared (live) weights, the step's gradient would
differ from this reference.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from prime_composer.config.loss import LossConfig, SDPOLossConfig
from prime_composer.model.resolve import resolve_model_name
from prime_composer.orchestrator.packing import pack_step
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.sdpo.packing import SDPOPacker
from prime_composer.orchestrator.sdpo.target import sdpo_target, set_sdpo_target
from prime_composer.trainer.losses.base import TermContext, build_terms
from prime_composer.trainer.step import StepResult, train_step
from prime_composer.transport.groups import SDPOGroup

SEQ_LEN = 48
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def model_path():
    torch.set_num_threads(1)
    return resolve_model_name("builtin:tiny-qwen3")


def _model(path):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="sdpa")


def _samples(hinted: list[bool]) -> list[Sample]:
    rng = random.Random(0)
    out = []
    for i, hint in enumerate(hinted):
        prompt = [rng.randint(3, 400) for _ in range(rng.randint(3, 8))]
        completion = [rng.randint(3, 400) for _ in range(rng.randint(3, 7))]
        s = Sample(
            prompt_ids=prompt,
            completion_ids=completion,
            completion_logprobs=[-1.0] * len(completion),
            completion_mask=[1] * len(completion),
            reward=0.0,
            example_id=i,
            group_id=i,
            policy_step=0,
            advantage=0.0,  # no policy gradient: the step's gradient is the SDPO term's alone
        )
        if hint:
            start = rng.randint(0, len(completion) - 2)
            hint_ids = [rng.randint(3, 400) for _ in range(rng.randint(2, 6))]
            set_sdpo_target(s, (start, len(completion)), prompt + completion[:start] + hint_ids)
        out.append(s)
    return out


def _pack(samples: list[Sample], micro_batch_size: int, temperature: float = TEMPERATURE):
    return pack_step(
        samples, SEQ_LEN, micro_batch_size, 1, pad_token_id=0, temperature=temperature, packers=[SDPOPacker()]
    )


def _step(model, mbs, cfg: LossConfig, ctx: TermContext | None = None) -> tuple[StepResult, TermContext]:
    ctx = ctx or TermContext(model)
    return train_step(model, mbs, build_terms(cfg, ctx), torch.device("cpu")), ctx


def _num_hinted_micro_batches(mbs) -> int:
    return sum(mb.group(SDPOGroup) is not None for mb in mbs)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference(path, samples: list[Sample], alpha: float) -> tuple[dict[str, torch.Tensor], float]:
    """Gradients of alpha * mean forward KL over the target tokens, and that mean KL."""
    model = _model(path)
    num_targets = sum(sdpo_target(s).span[1] - sdpo_target(s).span[0] for s in samples if sdpo_target(s))
    total = 0.0
    for s in samples:
        if sdpo_target(s) is None:
            continue
        start, end = sdpo_target(s).span
        target = s.completion_ids[start:end]
        student_ids = s.prompt_ids + s.completion_ids
        teacher_ids = sdpo_target(s).teacher_prefix_ids + target
        lo = len(s.prompt_ids) + start
        with torch.no_grad():
            t_logits = model(torch.tensor([teacher_ids])).logits[
                0, len(sdpo_target(s).teacher_prefix_ids) - 1 : -1
            ]
        s_logits = model(torch.tensor([student_ids])).logits[0, lo - 1 : lo - 1 + len(target)]
        log_t = (t_logits / TEMPERATURE).log_softmax(-1)
        log_s = (s_logits / TEMPERATURE).log_softmax(-1)
        total = total + (log_t.exp() * (log_t - log_s)).sum()
    (alpha * total / num_targets).backward()
    return _grads(model), float(total.detach()) / num_targets


@pytest.mark.parametrize("micro_batch_size", [1, 8])
def test_gradient_flows_only_through_the_student_with_a_live_teacher(model_path, micro_batch_size):
    samples = _samples([True, False, True, True, False])
    (mbs,), _ = _pack(samples, micro_batch_size)
    model = _model(model_path)
    alpha = 0.5
    cfg = LossConfig(sdpo=SDPOLossConfig(weight=alpha, beta=0.0, teacher="live"))
    result, ctx = _step(model, mbs, cfg)
    loss, metrics = result.loss, result.metrics
    got = _grads(model)
    expected, _ = _reference(model_path, samples, alpha)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-7, msg=name)
    # One teacher forward per hinted micro-batch, two where its short teacher rows run trimmed.
    hinted = _num_hinted_micro_batches(mbs)
    assert hinted <= ctx.copies["live"].num_forwards <= 2 * hinted
    assert metrics["loss/rl"] == pytest.approx(0.0, abs=1e-12)
    assert float(loss) == pytest.approx(alpha * metrics["loss/sdpo"])
    # beta = 0: the loss term is the forward KL, so the logged KL is the same number per token.
    assert metrics["sdpo/kl_teacher_student"] == pytest.approx(metrics["loss/sdpo"], rel=1e-6)
    assert metrics["sdpo/num_tokens"] == sum(
        sdpo_target(s).span[1] - sdpo_target(s).span[0] for s in samples if sdpo_target(s)
    )


def test_kl_metric_is_the_forward_kl_for_any_beta(model_path):
    samples = _samples([True, True, False, True])
    (mbs,), _ = _pack(samples, 2)
    model = _model(model_path)
    cfg = LossConfig(sdpo=SDPOLossConfig(weight=1.0, beta=0.5, teacher="live"))
    metrics = _step(model, mbs, cfg)[0].metrics
    _, kl = _reference(model_path, samples, 1.0)
    assert metrics["sdpo/kl_teacher_student"] == pytest.approx(kl, rel=1e-5)
    assert metrics["sdpo/divergence"] < kl  # the JSD of the same distributions is smaller


def test_weight_zero_runs_no_teacher_forward(model_path):
    samples = _samples([True, True, False])
    (mbs,), _ = _pack(samples, 1)
    model = _model(model_path)
    result, ctx = _step(model, mbs, LossConfig())
    assert ctx.copies == {} and "loss/sdpo" not in result.metrics  # no teacher was even made
    # On, it runs once per micro-batch that has a hinted sample.
    on = LossConfig(sdpo=SDPOLossConfig(weight=0.1, teacher="live"))
    model.zero_grad()
    _, ctx = _step(model, mbs, on)
    assert ctx.copies["live"].num_forwards == _num_hinted_micro_batches(mbs) >= 1


def test_terms_share_one_copy_per_kind_and_checkpoint_it(model_path):
    model = _model(model_path)
    ctx = TermContext(model)
    terms = build_terms(LossConfig(sdpo=SDPOLossConfig(weight=0.1, teacher="frozen")), ctx)
    assert [t.name for t in terms] == ["rl", "sdpo"]
    assert set(ctx.copies) == {"frozen"} and set(ctx.checkpoint_states()) == {"policy_copy_frozen"}
    # The KL reference is the frozen initial policy too: the same copy, not a second one.
    cfg = LossConfig(rl={"kl_coef": 0.1}, sdpo=SDPOLossConfig(weight=0.1, teacher="frozen"))
    ctx = TermContext(model)
    rl_term, sdpo_term = build_terms(cfg, ctx)
    assert rl_term.reference is sdpo_term.teacher is ctx.copies["frozen"]
    # A live teacher has no weights of its own to save.
    ctx = TermContext(model)
    build_terms(LossConfig(sdpo=SDPOLossConfig(weight=0.1, teacher="live")), ctx)
    assert ctx.checkpoint_states() == {}

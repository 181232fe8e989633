"""SDPO loss: generalized JSD against TRL (GKD and SDPO helpers) and against hand computations.

Hand cases are computed with ``fractions`` and ``math`` from the definitions
(M = beta * P_t + (1 - beta) * P_s; JSD = beta * KL(P_t || M) + (1 - beta) * KL(P_s || M);
beta 0 / 1 are KL(P_t || P_s) / KL(P_s || P_t)), never with the code under test.
"""

from __future__ import annotations

import math
import os
from fractions import Fraction as F

import pytest
import torch
from pydantic import ValidationError

from prime_composer.config.loss import SDPOLossConfig
from prime_composer.trainer.losses import sdpo as sdpo_module
from prime_composer.trainer.losses.aggregate import finalize_metrics, token_normalizer
from prime_composer.trainer.losses.sdpo import sdpo_loss

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(1)


def kl(p: list[F], q: list[F]) -> float:
    return sum(float(pi) * math.log(pi / qi) for pi, qi in zip(p, q, strict=True) if pi > 0)


def jsd(p_student: list[F], p_teacher: list[F], beta: F) -> float:
    if beta == 0:
        return kl(p_teacher, p_student)
    if beta == 1:
        return kl(p_student, p_teacher)
    mix = [beta * t + (1 - beta) * s for s, t in zip(p_student, p_teacher, strict=True)]
    return float(beta) * kl(p_teacher, mix) + float(1 - beta) * kl(p_student, mix)


def logits_for(probs: list[F], temperature: float, shift: float = 0.0) -> list[float]:
    """Logits whose softmax at ``temperature`` is ``probs`` (-inf for 0); a shift changes nothing."""
    return [temperature * math.log(p) + shift if p > 0 else float("-inf") for p in probs]


@pytest.fixture
def small_chunks(monkeypatch):
    """Several row chunks, so the chunked + checkpointed path is exercised."""
    monkeypatch.setattr(sdpo_module, "_CHUNK_ELEMENTS", 30)


def _random_logits(seed: int = 0, shape: tuple[int, int, int] = (2, 5, 13)):
    gen = torch.Generator().manual_seed(seed)
    student = 2 * torch.randn(shape, generator=gen, dtype=torch.float64)
    teacher = 2 * torch.randn(shape, generator=gen, dtype=torch.float64)
    mask = torch.rand(shape[:2], generator=gen) < 0.7
    mask[0, 0] = True
    return student, teacher, mask


# ---------------------------------------------------------------------------------- against TRL


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_trl_generalized_jsd(small_chunks, beta, temperature):
    from trl.experimental.gkd import GKDTrainer

    student, teacher, mask = _random_logits()
    ours_student = student.clone().requires_grad_(True)
    trl_student = student.clone().requires_grad_(True)
    cfg = SDPOLossConfig(beta=beta)
    loss, metrics = sdpo_loss(ours_student, teacher, mask, cfg, temperature, token_normalizer([mask]))
    labels = torch.where(mask, 0, -100)
    expected = GKDTrainer.generalized_jsd_loss(
        trl_student, teacher, labels=labels, beta=beta, temperature=temperature, reduction="batchmean"
    )
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(ours_student.grad, trl_student.grad, rtol=1e-9, atol=1e-12)
    assert finalize_metrics(metrics)["sdpo/divergence"] == pytest.approx(expected.item())


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_top_k_with_tail_matches_trl_sdpo(small_chunks, beta):
    from trl.experimental.sdpo.loss_utils import compute_topk_self_distillation_loss

    student, teacher, mask = _random_logits(seed=1)
    temperature = 0.8
    ours_student = student.clone().requires_grad_(True)
    trl_student = student.clone().requires_grad_(True)
    cfg = SDPOLossConfig(beta=beta, top_k=4)
    loss, _ = sdpo_loss(ours_student, teacher, mask, cfg, temperature, token_normalizer([mask]))
    per_token = compute_topk_self_distillation_loss(
        trl_student / temperature, teacher / temperature, distillation_topk=4, distillation_alpha=beta,
        distillation_add_tail=True,
    )  # fmt: skip
    expected = per_token[mask].sum() / mask.sum()
    torch.testing.assert_close(loss, expected, rtol=1e-9, atol=1e-12)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(ours_student.grad, trl_student.grad, rtol=1e-8, atol=1e-12)


# ---------------------------------------------------------------------------------- by hand

STUDENT = [F(1, 2), F(1, 4), F(1, 4)]
TEACHER = [F(1, 8), F(5, 8), F(1, 4)]


@pytest.mark.parametrize("beta", [F(0), F(1, 4), F(1, 2), F(1)])
def test_three_token_vocabulary_by_hand(beta):
    temperature = 2.0
    student = torch.tensor([[logits_for(STUDENT, temperature, shift=3.0)]], dtype=torch.float64)
    teacher = torch.tensor([[logits_for(TEACHER, temperature, shift=-1.0)]], dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, _ = sdpo_loss(student, teacher, mask, SDPOLossConfig(beta=float(beta)), temperature, 1)
    assert loss.item() == pytest.approx(jsd(STUDENT, TEACHER, beta), rel=1e-12)


def test_forward_kl_gradient_by_hand():
    # d KL(P_t || P_s) / d z_s = (P_s - P_t) / T, then / N for the normalizer N = 2.
    temperature = 0.5
    student = torch.tensor([[logits_for(STUDENT, temperature)] * 2], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([[logits_for(TEACHER, temperature)] * 2], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, _ = sdpo_loss(student, teacher, mask, SDPOLossConfig(beta=0.0), temperature, 2)
    loss.backward()
    expected_row = [float(s - t) / temperature / 2 for s, t in zip(STUDENT, TEACHER, strict=True)]
    torch.testing.assert_close(student.grad, torch.tensor([[expected_row] * 2], dtype=torch.float64))


@pytest.mark.parametrize("beta", [F(0), F(1, 2), F(1)])
def test_top_k_tail_bucket_by_hand(beta):
    # Vocab of 4; the student's top-2 are indices 1 and 3. The buckets are
    # (P[1], P[3], 1 - P[1] - P[3]) for both distributions.
    student_probs = [F(1, 10), F(1, 2), F(1, 10), F(3, 10)]
    teacher_probs = [F(3, 10), F(1, 5), F(1, 10), F(2, 5)]
    student_buckets = [F(1, 2), F(3, 10), F(1, 5)]
    teacher_buckets = [F(1, 5), F(2, 5), F(2, 5)]
    student = torch.tensor([[logits_for(student_probs, 1.0)]], dtype=torch.float64)
    teacher = torch.tensor([[logits_for(teacher_probs, 1.0)]], dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    cfg = SDPOLossConfig(beta=float(beta), top_k=2)
    loss, metrics = sdpo_loss(student, teacher, mask, cfg, 1.0, 1)
    assert loss.item() == pytest.approx(jsd(student_buckets, teacher_buckets, beta), rel=1e-12)
    out = finalize_metrics(metrics)
    assert out["sdpo/student_tail_mass"] == pytest.approx(0.2)
    assert out["sdpo/teacher_tail_mass"] == pytest.approx(0.4)


def test_masked_vocabulary_entries_stay_finite():
    # Teacher puts 0 on token 2 (logit -inf): KL(P_t || P_s) skips it; the JSD mixture is finite.
    student_probs = [F(1, 4), F(1, 4), F(1, 2)]
    teacher_probs = [F(1, 2), F(1, 2), F(0)]
    for beta in (F(0), F(1, 2)):
        student = torch.tensor([[logits_for(student_probs, 1.0)]], dtype=torch.float64, requires_grad=True)
        teacher = torch.tensor([[logits_for(teacher_probs, 1.0)]], dtype=torch.float64)
        loss, _ = sdpo_loss(
            student, teacher, torch.ones(1, 1, dtype=torch.bool), SDPOLossConfig(beta=float(beta)), 1.0, 1
        )
        loss.backward()
        assert loss.item() == pytest.approx(jsd(student_probs, teacher_probs, beta), rel=1e-12)
        assert torch.isfinite(student.grad).all()


def test_token_clip_caps_the_value_and_stops_the_gradient():
    temperature = 1.0
    divergence = jsd(STUDENT, TEACHER, F(1, 2))
    student_rows = [logits_for(STUDENT, temperature), logits_for(TEACHER, temperature)]  # 2nd: divergence 0
    student = torch.tensor([student_rows], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([[logits_for(TEACHER, temperature)] * 2], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    cfg = SDPOLossConfig(beta=0.5, token_clip=divergence / 2)
    loss, metrics = sdpo_loss(student, teacher, mask, cfg, temperature, 2)
    loss.backward()
    assert loss.item() == pytest.approx((divergence / 2 + 0.0) / 2)
    assert torch.equal(student.grad[0, 0], torch.zeros(3, dtype=torch.float64))
    out = finalize_metrics(metrics)
    assert out["sdpo/clip_frac"] == pytest.approx(0.5)
    assert out["sdpo/divergence"] == pytest.approx(divergence / 2)  # before the clip: (d + 0) / 2


def test_gradients_reach_only_the_student():
    # A live teacher shares the student's weights: its logits depend on the same leaf. The loss
    # must still differentiate only through the student path.
    student, teacher_offset, mask = _random_logits(seed=2)
    weights = student.clone().requires_grad_(True)
    loss, _ = sdpo_loss(
        weights, weights * 0.5 + teacher_offset, mask, SDPOLossConfig(), 0.9, token_normalizer([mask])
    )
    (grad_live,) = torch.autograd.grad(loss, weights)
    weights_2 = student.clone().requires_grad_(True)
    detached_teacher = (student * 0.5 + teacher_offset).detach()
    loss_2, _ = sdpo_loss(weights_2, detached_teacher, mask, SDPOLossConfig(), 0.9, token_normalizer([mask]))
    (grad_detached,) = torch.autograd.grad(loss_2, weights_2)
    torch.testing.assert_close(grad_live, grad_detached, rtol=0, atol=0)
    # And a teacher leaf that asks for gradients gets none.
    teacher_leaf = teacher_offset.clone().requires_grad_(True)
    sdpo_loss(weights_2, teacher_leaf, mask, SDPOLossConfig(), 0.9, 1.0)[0].backward()
    assert teacher_leaf.grad is None


@pytest.mark.parametrize("top_k", [None, 3])
def test_empty_mask_gives_zero_not_nan(top_k):
    student = torch.randn(2, 3, 7, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    normalizer = token_normalizer([mask])
    assert normalizer == 0
    loss, metrics = sdpo_loss(
        student, torch.randn(2, 3, 7), mask, SDPOLossConfig(top_k=top_k), 1.0, normalizer
    )
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(student.grad, torch.zeros(2, 3, 7))
    assert finalize_metrics(metrics) == {}


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="same shape"):
        sdpo_loss(torch.zeros(1, 2, 3), torch.zeros(1, 2, 4), torch.ones(1, 2), SDPOLossConfig(), 1.0, 1)
    with pytest.raises(ValueError, match="loss_mask"):
        sdpo_loss(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3), torch.ones(2, 2), SDPOLossConfig(), 1.0, 1)


def test_sdpo_config_validation():
    cfg = SDPOLossConfig()
    assert (cfg.weight, cfg.beta, cfg.teacher, cfg.ema_rate) == (0.0, 0.5, "ema", 0.99)
    with pytest.raises(ValidationError, match="beta"):
        SDPOLossConfig(beta=1.5)
    with pytest.raises(ValidationError, match="top_k"):
        SDPOLossConfig(top_k=0)
    with pytest.raises(ValidationError, match="token_clip"):
        SDPOLossConfig(token_clip=0.0)
    with pytest.raises(ValidationError, match="ema_rate only applies"):
        SDPOLossConfig(teacher="frozen", ema_rate=0.9)
    with pytest.raises(ValidationError, match="weight"):
        SDPOLossConfig(weight=-1.0)
    assert SDPOLossConfig(teacher="live").teacher == "live"


# ------------------------------------------------ closed-form backward against autograd


def _plain_divergence(student: torch.Tensor, teacher: torch.Tensor, beta: float, top_k: int | None):
    """Per-row divergence of [N, V] logits written out with differentiable torch ops only: log-softmax,
    optional top-k + tail buckets, and the generalized JSD with a logaddexp mixture."""
    log_s, log_t = student.log_softmax(-1), teacher.log_softmax(-1)
    if top_k is not None:
        index = student.detach().topk(top_k, dim=-1).indices
        outside = torch.ones_like(student, dtype=torch.bool).scatter(-1, index, False)
        tails = [
            torch.logsumexp(lp.masked_fill(~outside, float("-inf")), -1, keepdim=True)
            for lp in (log_s, log_t)
        ]
        log_s = torch.cat([log_s.gather(-1, index), tails[0]], -1)
        log_t = torch.cat([log_t.gather(-1, index), tails[1]], -1)
    if beta == 0.0:
        return (log_t.exp() * (log_t - log_s)).sum(-1)
    if beta == 1.0:
        return (log_s.exp() * (log_s - log_t)).sum(-1)
    log_m = torch.logaddexp(log_t + math.log(beta), log_s + math.log(1 - beta))
    kl_tm = (log_t.exp() * (log_t - log_m)).sum(-1)
    kl_sm = (log_s.exp() * (log_s - log_m)).sum(-1)
    return beta * kl_tm + (1 - beta) * kl_sm


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("top_k", [None, 4])
@pytest.mark.parametrize("clip", [False, True])
def test_closed_form_gradient_matches_autograd_of_the_formula(small_chunks, beta, top_k, clip):
    gen = torch.Generator().manual_seed(3)
    student = 2 * torch.randn(9, 17, generator=gen, dtype=torch.float64)
    teacher = 2 * torch.randn(9, 17, generator=gen, dtype=torch.float64)
    temperature, normalizer = 0.8, 12.0
    # Per-row weights, so each row's gradient is checked (not only their sum).
    weights = torch.rand(9, generator=gen, dtype=torch.float64) + 0.5

    reference_in = student.clone().requires_grad_(True)
    per_row = _plain_divergence(reference_in / temperature, teacher / temperature, beta, top_k)
    # A cap halfway between two rows' values (no row sits on it), clipping 4 of the 9 rows.
    ordered = per_row.detach().sort().values
    token_clip = float(ordered[4] + ordered[5]) / 2 if clip else None
    clipped = per_row.clamp(max=token_clip) if clip else per_row
    (weights * clipped).sum().div(normalizer).backward()

    ours_in = student.clone().requires_grad_(True)
    cfg = SDPOLossConfig(beta=beta, top_k=top_k, token_clip=token_clip)
    divergence, *_ = sdpo_module._GeneralizedJSD.apply(ours_in, teacher, beta, temperature, top_k, True)
    ours_clipped = divergence.clamp(max=token_clip) if clip else divergence
    (weights * ours_clipped).sum().div(normalizer).backward()

    torch.testing.assert_close(divergence.detach(), per_row.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours_in.grad, reference_in.grad, rtol=1e-9, atol=1e-12)
    if clip:
        assert (ours_in.grad.abs().sum(-1) == 0).sum() == 4  # rows above the clip get no gradient
    # And through the public entry point (uniform weights).
    rows_in = student.clone().requires_grad_(True)
    loss, _ = sdpo_module.sdpo_loss_rows(rows_in, teacher, cfg, temperature, normalizer)
    loss.backward()
    reference_in.grad = None
    _plain_divergence(reference_in / temperature, teacher / temperature, beta, top_k).clamp(
        max=token_clip if clip else float("inf")
    ).sum().div(normalizer).backward()
    torch.testing.assert_close(rows_in.grad, reference_in.grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(("beta", "top_k"), [(0.0, None), (0.3, None), (1.0, 3), (0.3, 3)])
def test_closed_form_gradient_passes_finite_differences(beta, top_k):
    gen = torch.Generator().manual_seed(4)
    student = torch.randn(4, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(4, 7, generator=gen, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda s: sdpo_module._GeneralizedJSD.apply(s, teacher, beta, 0.9, top_k, True)[0], (student,)
    )


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("top_k", [None, 20])
def test_float32_path_agrees_with_float64(beta, top_k):
    # Training runs the loss in float32 over a real-sized vocabulary: several CPU chunks.
    gen = torch.Generator().manual_seed(5)
    student = 3 * torch.randn(70, 4000, generator=gen, dtype=torch.float64)
    teacher = student + torch.randn(70, 4000, generator=gen, dtype=torch.float64)
    cfg = SDPOLossConfig(beta=beta, top_k=top_k)
    results = []
    for dtype in (torch.float64, torch.float32):
        s = student.to(dtype, copy=True).requires_grad_(True)
        loss, metrics = sdpo_module.sdpo_loss_rows(s, teacher.to(dtype), cfg, 1.0, 70)
        loss.backward()
        results.append((loss.double(), s.grad.double(), finalize_metrics(metrics)["sdpo/kl_teacher_student"]))
    (loss64, grad64, kl64), (loss32, grad32, kl32) = results
    torch.testing.assert_close(loss32, loss64, rtol=1e-5, atol=1e-6)
    # float32 rounding, relative to the largest gradient entry (small entries lose relative digits).
    torch.testing.assert_close(grad32, grad64, rtol=1e-4, atol=1e-5 * float(grad64.abs().max()))
    assert kl32 == pytest.approx(kl64, rel=1e-4)


@pytest.mark.parametrize("top_k", [None, 3])
def test_kl_metric_is_the_full_vocabulary_forward_kl(top_k):
    student_probs = [F(1, 10), F(1, 2), F(1, 10), F(3, 10)]
    teacher_probs = [F(3, 10), F(1, 5), F(1, 10), F(2, 5)]
    student = torch.tensor([logits_for(student_probs, 1.0)], dtype=torch.float64)
    teacher = torch.tensor([logits_for(teacher_probs, 1.0)], dtype=torch.float64)
    _, metrics = sdpo_module.sdpo_loss_rows(student, teacher, SDPOLossConfig(beta=0.5, top_k=top_k), 1.0, 1)
    assert finalize_metrics(metrics)["sdpo/kl_teacher_student"] == pytest.approx(
        kl(teacher_probs, student_probs),
        rel=1e-6,  # metrics are reduced in float32
    )


def test_no_gradient_buffer_without_grad(monkeypatch):
    """Under no_grad (e.g. an evaluation of the loss) the [N, V] gradient buffer is never made."""
    buffers: list[object] = []
    real = sdpo_module._chunk_forward

    def spy(student, teacher, beta, temperature, top_k, grad_out):
        buffers.append(grad_out)
        return real(student, teacher, beta, temperature, top_k, grad_out)

    monkeypatch.setattr(sdpo_module, "_chunk_forward", spy)
    student = torch.randn(3, 5, requires_grad=True)
    with torch.no_grad():
        loss, _ = sdpo_module.sdpo_loss_rows(student, torch.randn(3, 5), SDPOLossConfig(), 1.0, 3)
    assert not loss.requires_grad
    assert buffers and all(b is None for b in buffers)
    # With grad enabled the buffer is there (so the spy can tell the two apart).
    buffers.clear()
    loss, _ = sdpo_module.sdpo_loss_rows(student, torch.randn(3, 5), SDPOLossConfig(), 1.0, 3)
    assert loss.requires_grad and all(isinstance(b, torch.Tensor) for b in buffers)

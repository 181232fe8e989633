"""RL loss, its global normalizers and the log-prob helpers, checked against TRL and hand derivations.

TRL 1.16's ``GRPOTrainer._compute_loss`` is a method; it is called unbound on a small stand-in
object that supplies the attributes it reads, with the per-token log-probs injected through the
stand-in's ``_get_per_token_logps_and_entropies``, so both implementations see the same tensors.
Correspondence: token_mean <-> ``dapo``, sequence_mean <-> ``grpo``, constant <-> ``dr_grpo``.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from prime_composer.config.loss import LossConfig, RLLossConfig
from prime_composer.trainer.losses import logprobs as logprobs_module
from prime_composer.trainer.losses.aggregate import (
    accumulate_metrics,
    finalize_metrics,
    rl_normalizer,
)
from prime_composer.trainer.losses.logprobs import (
    entropy_from_logits,
    gather_logprobs,
    token_entropy,
    token_logprobs,
)
from prime_composer.trainer.losses.rl import rl_loss

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
torch.set_num_threads(1)

NO_MASK = {"mask_ratio_low": None, "mask_ratio_high": None}
TRL_LOSS_TYPE = {"token_mean": "dapo", "sequence_mean": "grpo", "constant": "dr_grpo"}


@pytest.fixture(scope="module")
def trl_grpo():
    """TRL's GRPOTrainer class (imported lazily: importing trl takes seconds)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    return GRPOTrainer


class _SingleProcessAccelerator:
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x


def _trl_loss(
    grpo_trainer, logprobs, old, adv, mask, *, loss_type, eps_low, eps_high, level, num_items,
    num_micro_batches, max_completion_length, kl_beta=0.0, ref=None,
):  # fmt: skip
    """TRL's loss for one micro-batch of a step with ``num_micro_batches`` accumulation steps."""
    stand_in = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logprobs, torch.zeros_like(logprobs), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=kl_beta,
        args=SimpleNamespace(
            use_bias_correction_kl=False, delta=None, steps_per_generation=num_micro_batches
        ),
        loss_type=loss_type,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        use_vllm=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=num_micro_batches,
        max_completion_length=max_completion_length,
        accelerator=_SingleProcessAccelerator(),
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
    )
    batch = logprobs.shape[0]
    inputs = {
        "prompt_ids": torch.zeros(batch, 0, dtype=torch.long),
        "prompt_mask": torch.zeros(batch, 0, dtype=torch.long),
        "completion_ids": torch.zeros(mask.shape, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": adv,
        "old_per_token_logps": old,
        "num_items_in_batch": torch.tensor(float(num_items)),
    }
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    loss = grpo_trainer._compute_loss(stand_in, None, inputs)
    return loss, stand_in._metrics["train"]


def _random_step(num_micro_batches: int = 2, batch: int = 4, seq_len: int = 7, seed: int = 0):
    """Micro-batches with ragged masks and ratios spread over all clip regions."""
    gen = torch.Generator().manual_seed(seed)
    micro_batches = []
    for _ in range(num_micro_batches):
        logprobs = -2.0 * torch.rand(batch, seq_len, generator=gen, dtype=torch.float64)
        old = logprobs + 0.4 * torch.randn(batch, seq_len, generator=gen, dtype=torch.float64)
        adv = torch.randn(batch, generator=gen, dtype=torch.float64)
        start = torch.randint(0, 3, (batch, 1), generator=gen)
        length = torch.randint(1, seq_len - 2, (batch, 1), generator=gen)
        pos = torch.arange(seq_len)[None]
        mask = (pos >= start) & (pos < start + length)
        ref = logprobs + 0.3 * torch.randn(batch, seq_len, generator=gen, dtype=torch.float64)
        micro_batches.append({"logprobs": logprobs, "old": old, "adv": adv, "mask": mask, "ref": ref})
    # One row with no loss token at all (a sequence whose completion was all environment tokens).
    micro_batches[-1]["mask"][0] = False
    return micro_batches


# ---------------------------------------------------------------------------------- against TRL


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize(("eps_low", "eps_high"), [(0.2, 0.28), (0.05, 0.05)])
def test_matches_trl_grpo_loss_and_gradient(trl_grpo, aggregation, ratio_level, eps_low, eps_high):
    micro_batches = _random_step()
    batch, seq_len = micro_batches[0]["mask"].shape
    num_micro = len(micro_batches)
    constant = float(num_micro * batch * seq_len) if aggregation == "constant" else None
    cfg = RLLossConfig(
        eps_low=eps_low, eps_high=eps_high, ratio_level=ratio_level, aggregation=aggregation,
        constant_normalizer=constant, **NO_MASK,
    )  # fmt: skip
    normalizer = rl_normalizer([mb["mask"] for mb in micro_batches], cfg)
    num_items = sum(int(mb["mask"].sum()) for mb in micro_batches)
    # sequence_mean: TRL's "grpo" divides by every row, the all-masked one included; ours divides
    # by the sequences that have a loss token (rl.py's convention), so ours is TRL's x rows / nonempty.
    num_rows = num_micro * batch
    num_nonempty = sum(int(mb["mask"].any(-1).sum()) for mb in micro_batches)
    assert num_nonempty == num_rows - 1
    scale = num_rows / num_nonempty if aggregation == "sequence_mean" else 1.0
    num_clipped = 0.0
    for mb in micro_batches:
        ours_lp = mb["logprobs"].clone().requires_grad_(True)
        trl_lp = mb["logprobs"].clone().requires_grad_(True)
        loss, metrics = rl_loss(ours_lp, mb["old"], mb["adv"], mb["mask"], cfg, normalizer)
        loss.backward()
        ref_loss, ref_metrics = _trl_loss(
            trl_grpo, trl_lp, mb["old"], mb["adv"], mb["mask"], loss_type=TRL_LOSS_TYPE[aggregation],
            eps_low=eps_low, eps_high=eps_high, level=ratio_level, num_items=num_items,
            num_micro_batches=num_micro, max_completion_length=seq_len,
        )  # fmt: skip
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss * scale, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(ours_lp.grad, trl_lp.grad * scale, rtol=1e-10, atol=1e-12)
        assert (ours_lp.grad[~mb["mask"]] == 0).all()  # the masked row gets no gradient
        if ratio_level == "token":  # TRL counts sequence-level clipping per sequence, we per token
            low, high = metrics["rl/clip_low_frac"], metrics["rl/clip_high_frac"]
            assert float(low[0] / low[1]) == pytest.approx(ref_metrics["clip_ratio/low_mean"][0])
            assert float(high[0] / high[1]) == pytest.approx(ref_metrics["clip_ratio/high_mean"][0])
            num_clipped += float(low[0] + high[0])
    if ratio_level == "token":
        assert num_clipped > 0, "the test data should exercise the clip"


def test_matches_trl_with_reference_kl(trl_grpo):
    micro_batches = _random_step(seed=1)
    cfg = RLLossConfig(kl_coef=0.05, **NO_MASK)
    normalizer = rl_normalizer([mb["mask"] for mb in micro_batches], cfg)
    for mb in micro_batches:
        ours_lp = mb["logprobs"].clone().requires_grad_(True)
        trl_lp = mb["logprobs"].clone().requires_grad_(True)
        loss, metrics = rl_loss(
            ours_lp, mb["old"], mb["adv"], mb["mask"], cfg, normalizer, ref_logprobs=mb["ref"]
        )
        loss.backward()
        ref_loss, ref_metrics = _trl_loss(
            trl_grpo, trl_lp, mb["old"], mb["adv"], mb["mask"], loss_type="dapo", eps_low=0.2, eps_high=0.28,
            level="token", num_items=normalizer, num_micro_batches=2, max_completion_length=7,
            kl_beta=0.05, ref=mb["ref"],
        )  # fmt: skip
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(ours_lp.grad, trl_lp.grad, rtol=1e-10, atol=1e-12)
        kl = metrics["rl/kl_ref"]
        assert float(kl[0] / kl[1]) == pytest.approx(ref_metrics["kl"][0])


# ---------------------------------------------------------------------------------- by hand


def test_on_policy_gradient_is_minus_advantage_over_token_count():
    # ratio 1 everywhere, no clip binds: d loss / d logp_t = -A_t / N on loss tokens, 0 elsewhere.
    logprobs = torch.tensor([[0.0, -1.0, -0.5, -2.0], [0.0, -0.3, -0.7, -0.1]], requires_grad=True)
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([2.0, -1.0])
    cfg = RLLossConfig()
    normalizer = rl_normalizer([mask], cfg)
    assert normalizer == 5
    loss, metrics = rl_loss(logprobs, logprobs.detach(), adv, mask, cfg, normalizer)
    loss.backward()
    expected = torch.tensor([[0, -2 / 5, -2 / 5, -2 / 5], [0, 1 / 5, 1 / 5, 0]])
    torch.testing.assert_close(logprobs.grad, expected)
    assert loss.item() == pytest.approx(-(3 * 2 - 2 * 1) / 5)
    out = finalize_metrics(metrics)
    assert out["rl/ratio"] == pytest.approx(1.0)
    assert out["rl/mismatch_kl"] == pytest.approx(0.0)
    assert out["rl/clip_low_frac"] == out["rl/clip_high_frac"] == out["rl/masked_frac"] == 0.0


def test_clip_regions_by_hand():
    # ratios 1.5, 0.5, 0.5, 1.5 with advantages +1, -1, +1, -1 and eps 0.2 / 0.28:
    #   r=1.5, A=+1: min(1.5, 1.28) = 1.28 -> clipped, no gradient
    #   r=0.5, A=-1: min(-0.5, -0.8) = -0.8 -> clipped, no gradient
    #   r=0.5, A=+1: min(0.5, 0.8) = 0.5 -> unclipped, d/dlogp = -A r / N = -0.5 / 4
    #   r=1.5, A=-1: min(-1.5, -1.28) = -1.5 -> unclipped, d/dlogp = -A r / N = +1.5 / 4
    # loss = -(1.28 - 0.8 + 0.5 - 1.5) / 4 = 0.13
    ratios = torch.tensor([[1.5, 0.5, 0.5, 1.5]], dtype=torch.float64)
    old = torch.full((1, 4), -1.0, dtype=torch.float64)
    logprobs = (old + ratios.log()).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    cfg = RLLossConfig(eps_low=0.2, eps_high=0.28)
    loss, metrics = rl_loss(logprobs, old, adv, mask, cfg, 4.0)
    loss.backward()
    assert loss.item() == pytest.approx(0.13)
    torch.testing.assert_close(
        logprobs.grad, torch.tensor([[0.0, 0.0, -0.5 / 4, 1.5 / 4]], dtype=torch.float64)
    )
    out = finalize_metrics(metrics)
    assert out["rl/clip_high_frac"] == pytest.approx(0.25)
    assert out["rl/clip_low_frac"] == pytest.approx(0.25)
    assert out["rl/ratio"] == pytest.approx(1.0)
    # k3 of KL(inference || trainer): mean of r - 1 - log r
    assert out["rl/mismatch_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in (1.5, 0.5, 0.5, 1.5)) / 4)


def test_extreme_ratios_are_masked_but_still_counted():
    # ratios 10 (above 8), 0.1 (below 1/8), 1: only the last token trains; the denominator stays 3.
    ratios = torch.tensor([[10.0, 0.1, 1.0]], dtype=torch.float64)
    old = torch.full((1, 3), -2.0, dtype=torch.float64)
    logprobs = (old + ratios.log()).requires_grad_(True)
    mask = torch.ones(1, 3, dtype=torch.bool)
    cfg = RLLossConfig(eps_high=10.0)  # clip at 11: wide enough not to bind at r = 10
    loss, metrics = rl_loss(logprobs, old, torch.tensor([1.0], dtype=torch.float64), mask, cfg, 3.0)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, -1 / 3]], dtype=torch.float64))
    assert loss.item() == pytest.approx(-1 / 3)
    assert finalize_metrics(metrics)["rl/masked_frac"] == pytest.approx(2 / 3)


def test_sequence_level_ratio_is_geometric_mean():
    # One sequence of 3 tokens with log-ratios 0.1, -0.05, 0.01: r = exp(0.02), inside the clip.
    # With token_mean over N = 3: loss = -3 r A / 3, d/dlogp_t = -A r / 3 for each token.
    log_ratio = torch.tensor([[0.0, 0.1, -0.05, 0.01]], dtype=torch.float64)
    old = torch.full((1, 4), -1.0, dtype=torch.float64)
    logprobs = (old + log_ratio).requires_grad_(True)
    mask = torch.tensor([[0, 1, 1, 1]], dtype=torch.bool)
    cfg = RLLossConfig(ratio_level="sequence")
    loss, metrics = rl_loss(logprobs, old, torch.tensor([2.0], dtype=torch.float64), mask, cfg, 3.0)
    loss.backward()
    r = math.exp(0.02)
    assert loss.item() == pytest.approx(-2 * r)
    torch.testing.assert_close(
        logprobs.grad, torch.tensor([[0.0, -2 * r / 3, -2 * r / 3, -2 * r / 3]], dtype=torch.float64)
    )
    assert finalize_metrics(metrics)["rl/ratio"] == pytest.approx(r)


def test_sequence_mean_with_packed_sequences():
    # One row packs sequence 0 (1 token, A=+1) and sequence 1 (3 tokens, A=-2); ratio 1.
    # sequence_mean over 2 sequences: d/dlogp_t = -A_s / (n_s * 2).
    logprobs = torch.tensor([[-0.5, -1.0, -0.2, -0.3, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)
    segments = torch.tensor([[0, 1, 1, 1, 0]])
    adv = torch.tensor([[1.0, -2.0, -2.0, -2.0, 0.0]])
    cfg = RLLossConfig(aggregation="sequence_mean")
    normalizer = rl_normalizer([mask], cfg, segment_ids=[segments])
    assert normalizer == 2
    loss, _ = rl_loss(logprobs, logprobs.detach(), adv, mask, cfg, normalizer, segment_ids=segments)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1 / 2, 2 / 6, 2 / 6, 2 / 6, 0.0]]))
    assert loss.item() == pytest.approx((-1 + 2) / 2)


def test_reference_kl_by_hand():
    # ref = logp + log 2: k3 = 2 - log 2 - 1 per token; d k3 / d logp = 1 - exp(ref - logp) = -1.
    logprobs = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = logprobs.detach() + math.log(2.0)
    mask = torch.ones(1, 2, dtype=torch.bool)
    cfg = RLLossConfig(kl_coef=0.1)
    loss, metrics = rl_loss(
        logprobs, logprobs.detach(), torch.zeros(1, dtype=torch.float64), mask, cfg, 2.0, ref_logprobs=ref
    )
    loss.backward()
    assert loss.item() == pytest.approx(0.1 * (1 - math.log(2)))
    torch.testing.assert_close(logprobs.grad, torch.full((1, 2), -0.1 / 2, dtype=torch.float64))
    assert finalize_metrics(metrics)["rl/kl_ref"] == pytest.approx(1 - math.log(2))


def test_reference_logprobs_must_match_kl_coef():
    lp, mask, adv = torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(1)
    with pytest.raises(ValueError, match="kl_coef > 0 needs ref_logprobs"):
        rl_loss(lp, lp, adv, mask, RLLossConfig(kl_coef=0.1), 2.0)
    with pytest.raises(ValueError, match="skip the reference forward"):
        rl_loss(lp, lp, adv, mask, RLLossConfig(), 2.0, ref_logprobs=lp)


def test_empty_step_gives_zero_not_nan():
    logprobs = torch.zeros(2, 3, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for aggregation in ("token_mean", "sequence_mean"):
        cfg = RLLossConfig(aggregation=aggregation)
        normalizer = rl_normalizer([mask], cfg)
        assert normalizer == 0
        loss, metrics = rl_loss(logprobs, logprobs.detach() - 1, torch.ones(2), mask, cfg, normalizer)
        loss.backward()
        assert loss.item() == 0.0
        assert torch.equal(logprobs.grad, torch.zeros(2, 3))
        assert finalize_metrics(metrics) == {}


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_gradient_does_not_depend_on_the_split(aggregation):
    """8 rows as 1 rank x 4 micro-batches, 2 ranks x 2, and 1 x 1 give the same summed gradient."""
    (full,) = _random_step(num_micro_batches=1, batch=8, seed=3)
    cfg = RLLossConfig(aggregation=aggregation)

    def summed_grad(splits: list[list[slice]]) -> tuple[torch.Tensor, dict[str, float]]:
        logprobs = full["logprobs"].clone().requires_grad_(True)
        all_rows = [rows for rank in splits for rows in rank]
        # What the all-reduce would give: every rank's micro-batches count.
        normalizer = rl_normalizer([full["mask"][rows] for rows in all_rows], cfg)
        acc: dict[str, torch.Tensor] = {}
        for rows in all_rows:
            loss, metrics = rl_loss(
                logprobs[rows], full["old"][rows], full["adv"][rows], full["mask"][rows], cfg, normalizer
            )
            loss.backward()
            accumulate_metrics(acc, metrics)
        return logprobs.grad, finalize_metrics(acc)

    one_rank = [[slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]]
    two_ranks = [[slice(0, 3), slice(3, 4)], [slice(4, 5), slice(5, 8)]]
    whole = [[slice(0, 8)]]
    grad_a, metrics_a = summed_grad(one_rank)
    grad_b, metrics_b = summed_grad(two_ranks)
    grad_c, metrics_c = summed_grad(whole)
    assert grad_a.abs().sum() > 0
    torch.testing.assert_close(grad_a, grad_b, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad_a, grad_c, rtol=1e-12, atol=1e-14)
    assert metrics_a == pytest.approx(metrics_b)
    assert metrics_a == pytest.approx(metrics_c)


# ---------------------------------------------------------------------------------- config


def test_rl_config_validation():
    assert RLLossConfig().eps_high == 0.28
    with pytest.raises(ValidationError, match="constant_normalizer"):
        RLLossConfig(aggregation="constant")
    with pytest.raises(ValidationError, match="only used with aggregation"):
        RLLossConfig(constant_normalizer=100.0)
    with pytest.raises(ValidationError, match="eps_low"):
        RLLossConfig(eps_low=-0.1)
    with pytest.raises(ValidationError, match="mask_ratio_low"):
        RLLossConfig(mask_ratio_low=2.0)
    with pytest.raises(ValidationError, match="mask_ratio_high"):
        RLLossConfig(mask_ratio_high=0.5)
    with pytest.raises(ValidationError, match="extra"):
        LossConfig.model_validate({"rl": {"eps_hgih": 0.3}})
    assert RLLossConfig.model_fields["eps_low"].description  # docstrings become descriptions


# ---------------------------------------------------------------------------------- log-probs


@pytest.fixture
def small_chunks(monkeypatch):
    """Force several row chunks so the chunk loop and its boundaries are exercised."""
    monkeypatch.setattr(logprobs_module, "_CHUNK_ELEMENTS", 40)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_matches_trl_and_autograd(small_chunks, temperature):
    from trl.trainer.utils import selective_log_softmax

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen, dtype=torch.float64) * 3
    ids = torch.randint(0, 11, (3, 5), generator=gen)
    ours_logits = logits.clone().requires_grad_(True)
    plain_logits = logits.clone().requires_grad_(True)
    ours = token_logprobs(ours_logits, ids, temperature)
    # Independent: TRL on explicitly shifted logits, and a plain log_softmax for the gradient.
    expected = selective_log_softmax(logits[:, :-1], ids[:, 1:], temperature)
    torch.testing.assert_close(ours[:, 1:], expected)
    assert torch.equal(ours[:, 0], torch.zeros(3, dtype=torch.float64))
    plain = torch.log_softmax(plain_logits[:, :-1] / temperature, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    weights = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    (ours[:, 1:] * weights).sum().backward()
    (plain * weights).sum().backward()
    torch.testing.assert_close(ours_logits.grad, plain_logits.grad)


def test_gather_logprobs_gradcheck(small_chunks):
    logits = torch.randn(6, 7, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (6,))
    assert torch.autograd.gradcheck(lambda x: gather_logprobs(x, targets, 0.6), (logits,))


def test_token_logprobs_bf16_is_close_to_fp32():
    logits = torch.randn(2, 9, 300) * 4
    ids = torch.randint(0, 300, (2, 9))
    ours = token_logprobs(logits.bfloat16(), ids, 0.8)
    assert ours.dtype == torch.float32
    reference = token_logprobs(logits.bfloat16().double(), ids, 0.8).float()
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_entropy_matches_trl_and_handles_masked_vocab(small_chunks):
    from trl.trainer.utils import entropy_from_logits as trl_entropy

    logits = torch.randn(2, 4, 9, dtype=torch.float64)
    torch.testing.assert_close(entropy_from_logits(logits, 0.5), trl_entropy(logits / 0.5))
    shifted = token_entropy(logits, 0.5)
    torch.testing.assert_close(shifted[:, 1:], trl_entropy(logits[:, :-1] / 0.5))
    # Uniform over the 2 finite entries: log 2, not NaN.
    masked = torch.tensor([[0.0, 0.0, float("-inf")]])
    assert entropy_from_logits(masked).item() == pytest.approx(math.log(2))


def test_temperature_must_be_positive():
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), 0.0)

"""DPO loss (sigmoid, IPO, robust), checked against TRL 1.16's own ``DPOTrainer`` loss code.

``DPOTrainer._compute_loss`` is a method that runs the model; it is called unbound on a stand-in
object with the attributes it reads, and a stand-in model whose "forward" returns given per-token
log-probs (zero outside the completion mask, as TRL's fused head does for ``-100`` labels). Both
implementations see the same leaf tensor, so losses *and* gradients are compared. TRL averages over
its batch; with the global pair count as normalizer ours is the same number.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from prime_composer.config.dpo import DPOLossConfig
from prime_composer.trainer.losses.aggregate import accumulate_metrics, finalize_metrics
from prime_composer.trainer.losses.dpo import dpo_loss, pair_normalizer

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def trl_dpo():
    from trl.trainer.dpo_trainer import DPOTrainer

    return DPOTrainer


class _Accelerator:
    device = torch.device("cpu")

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x


class _LogProbModel:
    """Stands in for the policy: returns the given per-token log-probs as TRL's fused head would."""

    training = True

    def __init__(self, per_token: torch.Tensor) -> None:
        self.per_token = per_token

    def __call__(self, input_ids, attention_mask, labels, fused_lm_head, use_cache):
        mask = (labels[:, 1:] != -100).to(self.per_token.dtype)
        zeros = torch.zeros_like(self.per_token)
        return SimpleNamespace(
            log_probs=self.per_token * mask,
            entropy=zeros.detach(),
            mean_logits=zeros.detach(),
            is_top1=torch.zeros_like(mask, dtype=torch.bool),
        )


def trl_loss(trl_dpo, per_token, completion_mask, ref_chosen, ref_rejected, loss_type, beta, label_smoothing):
    """TRL's loss for a batch laid out as TRL lays it out: rows [chosen..., rejected...]."""
    model = _LogProbModel(per_token)
    stand_in = SimpleNamespace(
        model=model,
        accelerator=_Accelerator(),
        aux_loss_enabled=False,
        precompute_ref_logps=True,
        ld_alpha=None,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=label_smoothing,
        use_weighting=False,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    rows = completion_mask.shape[0]
    inputs = {
        "input_ids": torch.zeros(rows, completion_mask.shape[1], dtype=torch.long),
        "attention_mask": torch.ones_like(completion_mask),
        "completion_mask": completion_mask,
        "ref_chosen_logps": ref_chosen,
        "ref_rejected_logps": ref_rejected,
    }
    return trl_dpo._compute_loss(stand_in, model, inputs, return_outputs=False)


def make_batch(num_pairs: int, seq_len: int, seed: int):
    """Per-token log-probs [2P, T-1] and a completion mask [2P, T] whose first token is prompt."""
    g = torch.Generator().manual_seed(seed)
    per_token = -torch.rand(2 * num_pairs, seq_len - 1, generator=g, dtype=torch.float64) * 3
    lengths = torch.randint(1, seq_len - 1, (2 * num_pairs,), generator=g)
    starts = torch.randint(1, 3, (2 * num_pairs,), generator=g)
    completion_mask = torch.zeros(2 * num_pairs, seq_len, dtype=torch.long)
    for i in range(2 * num_pairs):
        end = min(seq_len, int(starts[i] + lengths[i]))
        completion_mask[i, int(starts[i]) : end] = 1
    ref = (
        per_token.detach() * completion_mask[:, 1:]
        + 0.3
        * torch.randn(2 * num_pairs, seq_len - 1, generator=g, dtype=torch.float64)
        * completion_mask[:, 1:]
    )
    ref_sums = ref.sum(1)
    return per_token, completion_mask, ref_sums[:num_pairs], ref_sums[num_pairs:]


def ours(per_token, completion_mask, ref_chosen, ref_rejected, cfg, label_smoothing=None, normalizer=None):
    num_pairs = ref_chosen.shape[0]
    shift = completion_mask[:, 1:].to(per_token.dtype)
    sums = (per_token * shift).sum(1)
    counts = completion_mask.sum(1)
    return dpo_loss(
        sums[:num_pairs],
        sums[num_pairs:],
        ref_chosen,
        ref_rejected,
        cfg,
        normalizer=num_pairs if normalizer is None else normalizer,
        num_chosen_tokens=counts[:num_pairs],
        num_rejected_tokens=counts[num_pairs:],
        label_smoothing=label_smoothing,
    )


@pytest.mark.parametrize(
    ("loss_type", "beta", "eps"),
    [
        ("sigmoid", 0.1, 0.0),
        ("sigmoid", 1.5, 0.0),
        ("ipo", 0.1, 0.0),
        ("ipo", 0.5, 0.0),
        ("robust", 0.1, 0.2),
        ("robust", 0.7, 0.45),
    ],
)
def test_matches_trl_loss_and_gradient(trl_dpo, loss_type, beta, eps):
    per_token, mask, ref_c, ref_r = make_batch(num_pairs=5, seq_len=9, seed=int(beta * 100) + len(loss_type))
    cfg = DPOLossConfig(loss_type=loss_type, beta=beta, label_smoothing=eps, label_smoothing_from_votes=False)
    trl_lp = per_token.clone().requires_grad_(True)
    our_lp = per_token.clone().requires_grad_(True)
    expected = trl_loss(trl_dpo, trl_lp, mask, ref_c, ref_r, loss_type, beta, eps)
    loss, metrics = ours(our_lp, mask, ref_c, ref_r, cfg)
    expected.backward()
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(our_lp.grad, trl_lp.grad, rtol=1e-10, atol=1e-12)
    assert finalize_metrics(metrics)["dpo/loss"] == pytest.approx(
        expected.item(), rel=1e-6
    )  # float32 metrics


def test_sigmoid_label_smoothing_is_the_conservative_mixture_of_trl_losses(trl_dpo):
    """cDPO: (1 - eps) * DPO(chosen, rejected) + eps * DPO(rejected, chosen), both from TRL's code."""
    per_token, mask, ref_c, ref_r = make_batch(num_pairs=4, seq_len=8, seed=3)
    num_pairs, eps, beta = 4, 0.25, 0.3
    swapped_mask = torch.cat([mask[num_pairs:], mask[:num_pairs]])
    trl_lp = per_token.clone().requires_grad_(True)
    straight = trl_loss(trl_dpo, trl_lp, mask, ref_c, ref_r, "sigmoid", beta, 0.0)
    flipped = trl_loss(
        trl_dpo,
        torch.cat([trl_lp[num_pairs:], trl_lp[:num_pairs]]),
        swapped_mask,
        ref_r,
        ref_c,
        "sigmoid",
        beta,
        0.0,
    )
    expected = (1 - eps) * straight + eps * flipped
    our_lp = per_token.clone().requires_grad_(True)
    loss, _ = ours(our_lp, mask, ref_c, ref_r, DPOLossConfig(beta=beta), label_smoothing=eps)
    expected.backward()
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(our_lp.grad, trl_lp.grad, rtol=1e-10, atol=1e-12)


def test_per_pair_label_smoothing_equals_trl_one_pair_at_a_time(trl_dpo):
    """Each pair's own eps (from its vote share): the sum of TRL's one-pair losses with that eps."""
    per_token, mask, ref_c, ref_r = make_batch(num_pairs=3, seq_len=7, seed=11)
    eps = torch.tensor([0.0, 1 / 3, 0.4], dtype=torch.float64)
    beta = 0.2
    expected = torch.zeros((), dtype=torch.float64)
    for p in range(3):
        rows = [p, 3 + p]
        expected = expected + trl_loss(
            trl_dpo,
            per_token[rows],
            mask[rows],
            ref_c[p : p + 1],
            ref_r[p : p + 1],
            "robust",
            beta,
            float(eps[p]),
        )
    loss, metrics = ours(
        per_token, mask, ref_c, ref_r, DPOLossConfig(loss_type="robust", beta=beta), label_smoothing=eps
    )
    torch.testing.assert_close(loss * 3, expected, rtol=1e-12, atol=1e-12)
    assert finalize_metrics(metrics)["dpo/label_smoothing"] == pytest.approx(float(eps.mean()))


def test_hand_derived_value_and_metrics():
    """One pair: c - c_ref = 1, r - r_ref = -1, so h = 2; sigmoid loss = log(1 + exp(-beta h))."""
    cfg = DPOLossConfig(beta=0.5)
    c, r = torch.tensor([-3.0], dtype=torch.float64), torch.tensor([-5.0], dtype=torch.float64)
    loss, metrics = dpo_loss(c, r, torch.tensor([-4.0]), torch.tensor([-4.0]), cfg, normalizer=1)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-1.0)), rel=1e-12)
    values = finalize_metrics(metrics)
    assert values["dpo/margin"] == pytest.approx(1.0)
    assert values["dpo/chosen_reward"] == pytest.approx(0.5) and values[
        "dpo/rejected_reward"
    ] == pytest.approx(-0.5)
    assert values["dpo/accuracy"] == 1.0


def test_global_normalizer_makes_the_split_irrelevant():
    """Two micro-batches with the global pair count add up to the loss of one batch of all pairs."""
    per_token, mask, ref_c, ref_r = make_batch(num_pairs=6, seq_len=8, seed=5)
    cfg = DPOLossConfig(loss_type="robust", label_smoothing=0.1, label_smoothing_from_votes=False)
    whole, whole_metrics = ours(per_token, mask, ref_c, ref_r, cfg)
    parts, acc = [], {}
    for rows in ([0, 1], [2, 3, 4, 5]):
        index = rows + [6 + r for r in rows]
        loss, metrics = ours(per_token[index], mask[index], ref_c[rows], ref_r[rows], cfg, normalizer=6)
        parts.append(loss)
        accumulate_metrics(acc, metrics)
    torch.testing.assert_close(sum(parts), whole, rtol=1e-12, atol=1e-12)
    assert finalize_metrics(acc) == pytest.approx(finalize_metrics(whole_metrics))
    assert pair_normalizer(6) == 6.0  # no process group: the local count


def test_empty_and_zero_normalizer_give_zero_not_nan():
    cfg = DPOLossConfig()
    empty = torch.zeros(0, requires_grad=True)
    loss, metrics = dpo_loss(empty, empty, empty.detach(), empty.detach(), cfg, normalizer=0)
    loss.backward()
    assert loss.item() == 0.0 and finalize_metrics(metrics) == {}


def test_reference_logprobs_get_no_gradient():
    ref = torch.tensor([-1.0, -2.0], requires_grad=True)
    pol = torch.tensor([-1.5, -1.0], requires_grad=True)
    loss, _ = dpo_loss(pol, pol.flip(0), ref, ref.flip(0), DPOLossConfig(), normalizer=2)
    loss.backward()
    assert ref.grad is None and pol.grad is not None


def test_bad_inputs_are_clear_errors():
    cfg = DPOLossConfig(loss_type="ipo")
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="needs num_chosen_tokens"):
        dpo_loss(x, x, x, x, cfg, normalizer=2)
    with pytest.raises(ValueError, match=r"shape \[2\]"):
        dpo_loss(x, torch.zeros(3), x, x, DPOLossConfig(), normalizer=2)
    with pytest.raises(ValueError, match=r"\[0, 0.5\)"):
        dpo_loss(
            x,
            x,
            x,
            x,
            DPOLossConfig(loss_type="robust"),
            normalizer=2,
            label_smoothing=torch.tensor([0.1, 0.5]),
        )
    with pytest.raises(ValidationError, match="not used by loss_type"):
        DPOLossConfig(loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValidationError, match="label_smoothing_from_votes = false"):
        DPOLossConfig(loss_type="robust", label_smoothing=0.1)

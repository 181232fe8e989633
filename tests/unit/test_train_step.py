"""The trainer step on the tiny model: micro-batch splits give the same gradient, and the
on-policy loss equals its hand-derived value -sum(A_t) / N."""

from __future__ import annotations

import copy

import pytest
import torch

from prime_composer.config.base import ModelConfig
from prime_composer.config.loss import LossConfig
from prime_composer.orchestrator.packing import pack_step
from prime_composer.orchestrator.sample import Sample
from prime_composer.trainer.forward import forward_micro_batch
from prime_composer.trainer.losses.base import TermContext, build_terms
from prime_composer.trainer.model import load_model
from prime_composer.trainer.step import train_step


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    model, _ = load_model(ModelConfig(name="builtin:tiny-qwen3"), torch.device("cpu"))
    return model


def samples(model: torch.nn.Module) -> list[Sample]:
    """Six samples whose inference logprobs are the model's own (ratio 1, on-policy)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(6):
        prompt = torch.randint(
            5, 400, (int(torch.randint(3, 9, (1,), generator=gen)),), generator=gen
        ).tolist()
        completion = torch.randint(
            5, 400, (int(torch.randint(2, 7, (1,), generator=gen)),), generator=gen
        ).tolist()
        out.append(
            Sample(
                prompt_ids=prompt,
                completion_ids=completion,
                completion_logprobs=[0.0] * len(completion),
                completion_mask=[1] * len(completion),
                reward=float(i % 2),
                advantage=(-1.0) ** i * (0.25 + 0.1 * i),
                example_id=i // 2,
                group_id=i // 2,
                policy_step=0,
            )
        )
    # Fill in the model's own logprobs, scored one sample at a time (independent of packing).
    with torch.no_grad():
        for s in out:
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            logp = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
            s.completion_logprobs = logp[len(s.prompt_ids) - 1 :].tolist()
    return out


def grads_after_step(
    model: torch.nn.Module, batch: list[Sample], micro_batch_size: int
) -> tuple[float, dict]:
    fresh = copy.deepcopy(model)
    (micro_batches,), _ = pack_step(
        batch, seq_len=16, micro_batch_size=micro_batch_size, num_ranks=1, pad_token_id=0
    )
    terms = build_terms(LossConfig(), TermContext(fresh))
    loss = train_step(fresh, micro_batches, terms, torch.device("cpu")).loss
    return loss.item(), {n: p.grad.clone() for n, p in fresh.named_parameters() if p.grad is not None}


def test_split_into_micro_batches_does_not_change_the_gradient(model: torch.nn.Module) -> None:
    batch = samples(model)
    loss_one, grads_one = grads_after_step(model, batch, micro_batch_size=8)
    loss_many, grads_many = grads_after_step(model, batch, micro_batch_size=1)
    assert loss_one == pytest.approx(loss_many, abs=1e-6)
    for name, grad in grads_one.items():
        torch.testing.assert_close(grads_many[name], grad, atol=1e-6, rtol=1e-5)


def test_on_policy_loss_is_minus_mean_token_advantage(model: torch.nn.Module) -> None:
    batch = samples(model)
    num_tokens = sum(len(s.completion_ids) for s in batch)
    expected = -sum(s.advantage * len(s.completion_ids) for s in batch) / num_tokens
    loss, _ = grads_after_step(model, batch, micro_batch_size=2)
    assert loss == pytest.approx(expected, abs=1e-5)
    # And the packed forward really reproduces the per-sample logprobs (ratio 1).
    (micro_batches,), _ = pack_step(batch, seq_len=16, micro_batch_size=8, num_ranks=1, pad_token_id=0)
    with torch.no_grad():
        logprobs = forward_micro_batch(model, micro_batches[0]).logprobs
    mb = micro_batches[0]
    torch.testing.assert_close(logprobs[mb.loss_mask], mb.inference_logprobs[mb.loss_mask], atol=1e-5, rtol=0)


def test_kl_to_reference_runs_a_frozen_reference_forward(model: torch.nn.Module) -> None:
    """kl_coef > 0: the loss adds kl_coef * mean k3(ref - logp) with ref = the weights the term was
    built with, however far the policy has moved since (hand-derived, on-policy ratio 1)."""
    policy = copy.deepcopy(model)
    initial = copy.deepcopy(model)
    ctx = TermContext(policy)
    terms = build_terms(LossConfig(rl={"kl_coef": 0.2}), ctx)
    assert set(ctx.copies) == {"frozen"}
    with torch.no_grad():  # the policy moves away from its reference
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    batch = samples(policy)  # inference logprobs = the moved policy's own: ratio 1
    (micro_batches,), _ = pack_step(batch, seq_len=16, micro_batch_size=2, num_ranks=1, pad_token_id=0)
    result = train_step(policy, micro_batches, terms, torch.device("cpu"))

    num_tokens = sum(len(s.completion_ids) for s in batch)
    k3 = []
    with torch.no_grad():
        for s in batch:
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            ref = torch.log_softmax(initial(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
            ref = ref[len(s.prompt_ids) - 1 :]
            logp = torch.tensor(s.completion_logprobs)
            k3 += (torch.exp(ref - logp) - (ref - logp) - 1).tolist()
    mean_k3 = sum(k3) / num_tokens
    expected = -sum(s.advantage * len(s.completion_ids) for s in batch) / num_tokens + 0.2 * mean_k3
    assert mean_k3 > 1e-4  # the reference really differs from the policy
    assert result.metrics["rl/kl_ref"] == pytest.approx(mean_k3, rel=1e-4)
    assert result.loss.item() == pytest.approx(expected, abs=1e-5)
    assert ctx.copies["frozen"].num_forwards == len(micro_batches)

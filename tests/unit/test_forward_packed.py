"""Packed forward on the tiny Qwen3: samples sharing a row must not see each other."""

from __future__ import annotations

import os
from dataclasses import replace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest
import torch
from transformers import AutoModelForCausalLM

from prime_composer.model.resolve import resolve_model_name
from prime_composer.orchestrator.packing import pack_step
from prime_composer.orchestrator.sample import Sample
from prime_composer.trainer.forward import packed_token_logprobs
from prime_composer.transport.batch import MicroBatch


@pytest.fixture(scope="module")
def model_path() -> str:
    torch.set_num_threads(1)
    return resolve_model_name("builtin:tiny-qwen3")


def load(path: str, attention: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention)


def make_samples(lengths: list[tuple[int, int]], seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, (num_prompt, num_completion) in enumerate(lengths):
        ids = torch.randint(3, 450, (num_prompt + num_completion,), generator=g).tolist()
        samples.append(
            Sample(
                prompt_ids=ids[:num_prompt],
                completion_ids=ids[num_prompt:],
                completion_logprobs=[-1.0] * num_completion,
                completion_mask=[1] * num_completion,
                reward=0.0,
                example_id=i,
                group_id=i,
                policy_step=0,
                advantage=float(torch.randn(1, generator=g)),
            )
        )
    return samples


def alone_logprobs(model: torch.nn.Module, sample: Sample, temperature: float = 1.0) -> torch.Tensor:
    """Textbook scoring of one unpacked sample: log_softmax of the plain forward, shifted by one."""
    ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
    logprobs = torch.log_softmax(model(ids).logits.float() / temperature, dim=-1)
    return logprobs[0, :-1].gather(-1, ids[0, 1:, None]).squeeze(-1)


def max_diff_per_sample(
    model: torch.nn.Module,
    samples: list[Sample],
    mb: MicroBatch,
    temperature: float,
    check_starts: bool = True,
) -> list[float]:
    with torch.no_grad():
        packed, _ = packed_token_logprobs(model, mb, temperature)
        diffs = []
        for i, sample in enumerate(samples):
            row, cols = (mb.sample_ids == i).nonzero(as_tuple=True)
            got = packed[row, cols]
            if check_starts:
                assert got[0].item() == 0.0  # the first token of a sample has no prediction
            diffs.append((got[1:] - alone_logprobs(model, sample, temperature)).abs().max().item())
    return diffs


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_equals_one_by_one(model_path: str, attention: str, temperature: float) -> None:
    model = load(model_path, attention).eval()
    samples = make_samples([(5, 9), (3, 12), (7, 4)])
    (micro_batches,), _ = pack_step(samples, seq_len=40, micro_batch_size=1, num_ranks=1, pad_token_id=0)
    (mb,) = micro_batches
    assert mb.num_rows == 1  # all three share one row, followed by padding
    assert max(max_diff_per_sample(model, samples, mb, temperature)) < 1e-5


def test_without_restarting_positions_samples_leak(model_path: str) -> None:
    """The check above can fail: numbering the row 0..T-1 lets later samples see earlier ones."""
    model = load(model_path).eval()
    samples = make_samples([(5, 9), (3, 12), (7, 4)])
    (micro_batches,), _ = pack_step(samples, seq_len=40, micro_batch_size=1, num_ranks=1, pad_token_id=0)
    mb = micro_batches[0]
    leaky = replace(mb, position_ids=torch.arange(40).expand(1, 40).clone())
    diffs = max_diff_per_sample(model, samples, leaky, 1.0, check_starts=False)
    first = mb.sample_ids[0, 0].item()  # the one sample that has nothing before it
    assert diffs.pop(first) < 1e-5
    assert min(diffs) > 1e-3


def test_logits_are_aligned_with_tokens(model_path: str) -> None:
    model = load(model_path).eval()
    samples = make_samples([(4, 6), (2, 5)])
    (micro_batches,), _ = pack_step(samples, seq_len=20, micro_batch_size=1, num_ranks=1, pad_token_id=0)
    mb = micro_batches[0]
    with torch.no_grad():
        logprobs, logits = packed_token_logprobs(model, mb, 2.0, return_logits=True)
    assert logits is not None and logits.shape == (1, 20, model.config.vocab_size)
    from_logits = torch.log_softmax(logits, -1).gather(-1, mb.input_ids[..., None]).squeeze(-1)
    inside = mb.position_ids != 0
    assert torch.allclose(from_logits[inside], logprobs[inside], atol=1e-6)
    assert (logits[~inside] == 0).all()


def surrogate_grads(model: torch.nn.Module, rank_batches: list[list[MicroBatch]]) -> dict[str, torch.Tensor]:
    """Sum over ranks (what an all-reduce does) of the accumulated grads of a token-mean loss."""
    model.zero_grad()
    num_loss_tokens = sum(int(mb.loss_mask.sum()) for micro_batches in rank_batches for mb in micro_batches)
    for micro_batches in rank_batches:
        for mb in micro_batches:
            logprobs, _ = packed_token_logprobs(model, mb, 1.0)
            loss = -(mb.advantages * logprobs * mb.loss_mask).sum() / num_loss_tokens
            loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_same_gradient_for_one_rank_by_four_and_two_by_two(model_path: str) -> None:
    model = load(model_path)
    samples = make_samples([(4, 4)] * 8, seed=1)  # 8 x 8 tokens -> 4 rows of 16
    one, _ = pack_step(samples, seq_len=16, micro_batch_size=1, num_ranks=1, pad_token_id=0)
    two, _ = pack_step(samples, seq_len=16, micro_batch_size=1, num_ranks=2, pad_token_id=0)
    assert [len(r) for r in one] == [4] and [len(r) for r in two] == [2, 2]
    grads_one, grads_two = surrogate_grads(model, one), surrogate_grads(model, two)
    assert grads_one.keys() == grads_two.keys() and len(grads_one) > 0
    for name, grad in grads_one.items():
        assert torch.allclose(grad, grads_two[name], atol=1e-6, rtol=1e-5), name
    assert any(g.abs().max() > 1e-4 for g in grads_one.values())


def test_unknown_attention_is_refused(model_path: str) -> None:
    model = load(model_path)
    model.config._attn_implementation = "paged|sdpa"
    (micro_batches,), _ = pack_step(
        make_samples([(2, 2)]), seq_len=8, micro_batch_size=1, num_ranks=1, pad_token_id=0
    )
    with pytest.raises(ValueError, match="attn_implementation"):
        packed_token_logprobs(model, micro_batches[0], 1.0)

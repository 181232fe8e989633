"""Packed lean forward on the tiny Qwen3: samples sharing a row must not see each other, and the
chunked head gives the logprobs, entropies, logits and gradients of the textbook full-logits
computation (written out here with ``log_softmax`` over the plain model output)."""

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
from prime_composer.trainer import forward as forward_module
from prime_composer.trainer.forward import forward_micro_batch, head_logprobs
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


def score_everything(mb: MicroBatch, temperature: float = 1.0) -> MicroBatch:
    """``mb`` with every token but the first of each sample in the loss mask (so all are scored)."""
    return replace(mb, loss_mask=(mb.sample_ids >= 0) & (mb.position_ids != 0), temperature=temperature)


def max_diff_per_sample(
    model: torch.nn.Module,
    samples: list[Sample],
    mb: MicroBatch,
    temperature: float,
    check_starts: bool = True,
) -> list[float]:
    with torch.no_grad():
        packed = forward_micro_batch(model, score_everything(mb, temperature)).logprobs
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
    leaky = replace(score_everything(mb), position_ids=torch.arange(40).expand(1, 40).clone())
    diffs = max_diff_per_sample(model, samples, leaky, 1.0, check_starts=False)
    first = mb.sample_ids[0, 0].item()  # the one sample that has nothing before it
    assert diffs.pop(first) < 1e-5
    assert min(diffs) > 1e-3


def full_logits(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """The textbook ``[R, T, V]`` logits aligned with the tokens: ``out[:, t]`` predicts token ``t``."""
    logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.cat([torch.zeros_like(logits[:, :1]), logits[:, :-1]], dim=1) / mb.temperature


def test_logprobs_entropy_and_logits_match_the_full_logits(model_path: str) -> None:
    model = load(model_path).eval()
    samples = make_samples([(4, 6), (2, 5), (3, 3)])
    (micro_batches,), _ = pack_step(
        samples, seq_len=20, micro_batch_size=2, num_ranks=1, pad_token_id=0, temperature=2.0
    )
    mb = micro_batches[0]
    wanted = mb.loss_mask.clone()
    wanted[0, wanted[0].nonzero()[0]] = False  # some subset of the loss tokens
    with torch.no_grad():
        out = forward_micro_batch(model, mb, logits_masks={"x": wanted})
        reference = full_logits(model, mb)
    log_p = reference.log_softmax(-1)
    mask = mb.loss_mask
    expected = log_p.gather(-1, mb.input_ids[..., None]).squeeze(-1)
    torch.testing.assert_close(out.logprobs[mask], expected[mask], atol=1e-6, rtol=0)
    assert (out.logprobs[~mask] == 0).all() and (out.entropy[~mask] == 0).all()
    entropy = -(log_p.exp() * log_p).sum(-1)
    torch.testing.assert_close(out.entropy[mask], entropy[mask], atol=1e-5, rtol=0)
    assert out.logits["x"].shape == (int(wanted.sum()), model.config.vocab_size)
    torch.testing.assert_close(out.logits["x"], reference[wanted], atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradients_match_autograd_of_the_full_logits(
    model_path: str, temperature: float, monkeypatch
) -> None:
    # Tiny chunks, so the chunked passes really cut the tokens into many pieces.
    monkeypatch.setattr(forward_module, "CHUNK_ELEMENTS", 3 * 4096)
    samples = make_samples([(4, 6), (2, 5), (3, 7)], seed=3)
    (micro_batches,), _ = pack_step(
        samples, seq_len=32, micro_batch_size=1, num_ranks=1, pad_token_id=0, temperature=temperature
    )
    mb = micro_batches[0]
    lean, textbook = load(model_path).double(), load(model_path).double()
    wanted = mb.loss_mask.clone()
    out = forward_micro_batch(lean, mb, logits_masks={"x": wanted})
    # A loss that uses both outputs: the advantage-weighted logprobs and a function of the logits.
    (-(mb.advantages * out.logprobs).sum() + out.logits["x"].logsumexp(-1).sum() * 0.1).backward()
    reference = full_logits(textbook, mb)
    ref_logp = reference.log_softmax(-1).gather(-1, mb.input_ids[..., None]).squeeze(-1)
    loss = -(mb.advantages * ref_logp * mb.loss_mask).sum() + reference[wanted].logsumexp(-1).sum() * 0.1
    loss.backward()
    grads = {n: p.grad for n, p in textbook.named_parameters() if p.grad is not None}
    assert {n for n, p in lean.named_parameters() if p.grad is not None} == set(grads)
    for name, param in lean.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], atol=1e-10, rtol=1e-8, msg=name)
    assert any(g.abs().max() > 1e-4 for g in grads.values())


def test_head_with_bias_and_low_precision_input() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=True).double()
    hidden = torch.randn(13, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (13,))
    weights = torch.randn(13, dtype=torch.float64)
    lp, ent, _ = head_logprobs(hidden, head, targets, 0.5)
    (lp * weights).sum().backward()
    got = (hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone())
    hidden.grad = head.weight.grad = head.bias.grad = None
    log_p = (head(hidden) / 0.5).log_softmax(-1)
    (log_p.gather(-1, targets[:, None]).squeeze(-1) * weights).sum().backward()
    torch.testing.assert_close(lp.double(), log_p.gather(-1, targets[:, None]).squeeze(-1), atol=1e-6, rtol=0)
    torch.testing.assert_close(ent.double(), -(log_p.exp() * log_p).sum(-1), atol=1e-5, rtol=0)
    for mine, expected in zip(got, (hidden.grad, head.weight.grad, head.bias.grad), strict=True):
        torch.testing.assert_close(mine, expected, atol=1e-6, rtol=1e-5)
    # No loss token at all: empty outputs, zero (not missing) gradients.
    empty = torch.zeros(0, 8, dtype=torch.float64, requires_grad=True)
    lp, _, _ = head_logprobs(empty, head, targets[:0], 1.0)
    assert lp.shape == (0,)


@pytest.mark.parametrize("keep", [True, False], ids=["probs-kept", "recomputed"])
def test_head_logits_rows_share_the_logprobs_chunks(monkeypatch: pytest.MonkeyPatch, keep: bool) -> None:
    """Logits asked for beside the logprobs (unsorted, repeated, across chunk edges) and their
    gradient, joined in the same backward, against autograd of the plain formula."""
    monkeypatch.setattr(forward_module, "CHUNK_ELEMENTS", 4 * 50)  # 4 rows per chunk: 4 chunks
    monkeypatch.setattr(forward_module, "KEEP_ELEMENTS", 1 << 20 if keep else 0)
    torch.manual_seed(1)
    head = torch.nn.Linear(8, 50, bias=True).double()
    hidden = torch.randn(13, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (13,))
    rows = torch.tensor([12, 3, 4, 3, 0, 7])
    w_lp, w_logits = torch.randn(13, dtype=torch.float64), torch.randn(6, 50, dtype=torch.float64)
    lp, ent, logits = head_logprobs(hidden, head, targets, 0.7, True, rows)
    ((lp * w_lp).sum() + (logits.pow(2) * w_logits).sum()).backward()
    got = (hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone())
    hidden.grad = head.weight.grad = head.bias.grad = None
    z = head(hidden) / 0.7
    log_p = z.log_softmax(-1)
    expected_lp = log_p.gather(-1, targets[:, None]).squeeze(-1)
    ((expected_lp * w_lp).sum() + (z[rows].pow(2) * w_logits).sum()).backward()
    torch.testing.assert_close(lp, expected_lp.detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(logits, z[rows].detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(ent, -(log_p.exp() * log_p).sum(-1).detach(), atol=1e-12, rtol=0)
    for mine, expected in zip(got, (hidden.grad, head.weight.grad, head.bias.grad), strict=True):
        torch.testing.assert_close(mine, expected, atol=1e-10, rtol=1e-8)


def surrogate_grads(model: torch.nn.Module, rank_batches: list[list[MicroBatch]]) -> dict[str, torch.Tensor]:
    """Sum over ranks (what an all-reduce does) of the accumulated grads of a token-mean loss."""
    model.zero_grad()
    num_loss_tokens = sum(int(mb.loss_mask.sum()) for micro_batches in rank_batches for mb in micro_batches)
    for micro_batches in rank_batches:
        for mb in micro_batches:
            logprobs = forward_micro_batch(model, mb).logprobs
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


def test_unknown_attention_and_post_head_transforms_are_refused(model_path: str) -> None:
    (micro_batches,), _ = pack_step(
        make_samples([(2, 2)]), seq_len=8, micro_batch_size=1, num_ranks=1, pad_token_id=0
    )
    model = load(model_path)
    model.config._attn_implementation = "paged|sdpa"
    with pytest.raises(ValueError, match="attn_implementation"):
        forward_micro_batch(model, micro_batches[0])
    model = load(model_path)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        forward_micro_batch(model, micro_batches[0])

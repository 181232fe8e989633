"""Sampling and logprobs (inference/hf/sampling.py) against hand-computed values."""

from __future__ import annotations

import math

import torch

from prime_composer.inference.hf.sampling import make_generator, sample_rows

CPU = torch.device("cpu")


def _gens(num: int, seed: int = 0) -> list[torch.Generator]:
    return [make_generator(seed, i, CPU) for i in range(num)]


def test_logprob_is_log_softmax_after_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    out = sample_rows(logits, [0.5], [1.0], _gens(1), num_top=3)
    # By hand: logits / 0.5 = [4, 2, 0]; log Z = log(e^4 + e^2 + 1).
    log_z = math.log(math.exp(4) + math.exp(2) + 1)
    expected = {0: 4 - log_z, 1: 2 - log_z, 2: 0 - log_z}
    token = out.token_ids[0]
    assert abs(out.logprobs[0] - expected[token]) < 1e-6
    assert [t for t, _ in out.top_logprobs[0]] == [0, 1, 2]
    assert all(abs(lp - expected[t]) < 1e-6 for t, lp in out.top_logprobs[0])


def test_greedy_reports_temperature_one_logprob():
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    out = sample_rows(logits, [0.0], [1.0], _gens(1), num_top=0)
    log_z = math.log(1 + math.exp(3) + math.exp(1))
    assert out.token_ids == [1]
    assert abs(out.logprobs[0] - (3 - log_z)) < 1e-6
    assert out.top_logprobs is None


def test_top_p_samples_inside_nucleus_but_reports_untruncated_logprob():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().unsqueeze(0)
    gen = make_generator(123, 0, CPU)
    counts = [0, 0, 0, 0]
    for _ in range(2000):
        out = sample_rows(logits, [1.0], [0.7], [gen], num_top=0)
        token = out.token_ids[0]
        counts[token] += 1
        # reported: log p before truncation (0.5 or 0.3), not the renormalized 0.625 / 0.375
        assert abs(out.logprobs[0] - math.log(probs[token].item())) < 1e-5
    assert counts[2] == counts[3] == 0  # outside the nucleus {0, 1} (mass before token 2 is 0.8 >= 0.7)
    assert abs(counts[0] / 2000 - 0.625) < 0.05  # renormalized 0.5 / 0.8


def test_seeded_rows_are_reproducible_and_independent_of_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    alone = [sample_rows(logits[1:2], [1.0], [1.0], [make_generator(7, 0, CPU)], 0).token_ids[0]]
    gens = [make_generator(1, 0, CPU), make_generator(7, 0, CPU), make_generator(2, 0, CPU)]
    batched = sample_rows(logits, [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], gens, 0).token_ids
    assert batched[1] == alone[0]
    # choices of one request draw different streams
    a = torch.rand(8, generator=make_generator(7, 0, CPU))
    b = torch.rand(8, generator=make_generator(7, 1, CPU))
    assert not torch.equal(a, b)


def test_top_p_that_rounds_to_zero_keeps_the_most_likely_token():
    # 1e-300 is 0.0 in float32; the nucleus once kept no token and the sampler returned the last
    # id of the vocabulary. The most likely token (argmax, computed independently) must win.
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    generators = [torch.Generator().manual_seed(i) for i in range(4)]
    sampled = sample_rows(logits, [1.0] * 4, [1e-300] * 4, generators, num_top=0)
    assert sampled.token_ids == logits.argmax(dim=-1).tolist()
    expected = torch.log_softmax(logits, -1).max(dim=-1).values
    assert torch.allclose(torch.tensor(sampled.logprobs), expected)

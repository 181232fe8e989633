"""The continuous-batching decode loop (inference/hf/engine.py) against plain full-sequence forwards.

The reference for every logprob is an independent computation: one forward of the Hugging Face
model over prompt + completion (no cache, no padding), ``log_softmax(logits / T)`` at each
completion position. Greedy output is also compared with transformers' own ``generate``.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from prime_composer.inference.hf.engine import MIN_SHARED_PREFIX, Engine
from prime_composer.inference.requests import GenerationRequest, SamplingParams
from prime_composer.model.resolve import resolve_model_name

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    path = resolve_model_name("builtin:tiny-qwen3")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, tokenizer


def _engine(model, tokenizer, **kwargs) -> Engine:
    options = {"max_model_len": 1024, "max_num_seqs": 8, "max_prefill_tokens": 256, "seed": 0, **kwargs}
    engine = Engine(model, tokenizer, **options)
    engine.start()
    return engine


async def _run(engine: Engine, prompt: list[int], delay: float = 0.0, **params) -> list[dict]:
    await asyncio.sleep(delay)
    request = GenerationRequest(prompt, SamplingParams(**params))
    choices = [{"ids": [], "logprobs": [], "top": [], "finish": None} for _ in range(request.params.n)]
    async for updates in engine.generate(request):
        for u in updates:
            c = choices[u.index]
            c["ids"] += u.token_ids
            c["logprobs"] += u.logprobs
            c["top"] += u.top_logprobs
            c["finish"] = u.finish_reason or c["finish"]
    return choices


def _reference_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """[len(completion), vocab] log_softmax(logits / T) from one plain forward (T = 0 -> 1)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / (temperature or 1.0), dim=-1)


def _max_error(model, prompt, choice, temperature) -> float:
    ref = _reference_logprobs(model, prompt, choice["ids"], temperature)
    ours = torch.tensor(choice["logprobs"])
    picked = ref.gather(1, torch.tensor(choice["ids"]).unsqueeze(1)).squeeze(1)
    return (picked - ours).abs().max().item()


def test_batched_decode_matches_full_forward(tiny):
    model, tokenizer = tiny
    texts = ["What is 1 + 2?", "x", "You are a helpful assistant. Sort these letters: d c b a", "def f():"]
    prompts = [tokenizer.encode(t) for t in texts]
    # 4 slots for 8 sequences and a small prefill budget: requests wait, join a running batch
    # and leave it at different times.
    engine = _engine(model, tokenizer, max_num_seqs=4, max_prefill_tokens=24)
    jobs = [
        (prompts[0], {"temperature": 0.7, "max_tokens": 9}),
        (prompts[1], {"temperature": 0.0, "max_tokens": 17}),
        (prompts[2], {"temperature": 1.0, "max_tokens": 5, "n": 3}),
        (prompts[3], {"temperature": 1.3, "top_p": 0.9, "max_tokens": 13, "num_top_logprobs": 3}),
        (prompts[0], {"temperature": 1.0, "max_tokens": 21}),
    ]

    async def main():
        tasks = [_run(engine, p, 0.002 * i, ignore_eos=True, **kw) for i, (p, kw) in enumerate(jobs)]
        return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(main())
    finally:
        engine.stop()
    for (prompt, kw), choices in zip(jobs, results, strict=True):
        assert len(choices) == kw.get("n", 1)
        for choice in choices:
            assert len(choice["ids"]) == kw["max_tokens"] and choice["finish"] == "length"
            assert _max_error(model, prompt, choice, kw["temperature"]) < TOL
            if kw["temperature"] == 0:
                ref = _reference_logprobs(model, prompt, choice["ids"], 0.0)
                assert choice["ids"] == ref.argmax(-1).tolist()
            if kw.get("num_top_logprobs"):
                ref = _reference_logprobs(model, prompt, choice["ids"], kw["temperature"])
                for step, top in enumerate(choice["top"]):
                    want = ref[step].topk(3)
                    assert [t for t, _ in top] == want.indices.tolist()
                    assert (
                        max(abs(lp - w) for (_, lp), w in zip(top, want.values.tolist(), strict=True)) < TOL
                    )


def test_shared_prompt_prefix_runs_once_and_matches_full_forward(tiny):
    model, tokenizer = tiny
    header = tokenizer.encode("<|im_start|>system\nYou are terse.<|im_end|>\n")
    tails = ["x", "What is 2 + 2? Think it through, step by step, then answer.", "Sort: c b a", "12"]
    prompts = [header + tokenizer.encode(t) for t in tails]
    # Independent of the engine: the longest common prefix of the token lists, leaving one token.
    common = next((i for i, column in enumerate(zip(*prompts, strict=False)) if len(set(column)) > 1), None)
    expected_shared = min(common, min(len(p) for p in prompts) - 1)
    assert expected_shared >= MIN_SHARED_PREFIX
    # the longest suffix's padding is longer than the prefix itself for the shortest prompt
    assert max(len(p) for p in prompts) - min(len(p) for p in prompts) > expected_shared
    engine = Engine(  # started below, once every request is queued
        model, tokenizer, max_model_len=1024, max_num_seqs=8, max_prefill_tokens=1024
    )
    jobs = [
        (prompts[0], {"temperature": 0.0, "max_tokens": 11}),
        (prompts[1], {"temperature": 1.0, "max_tokens": 7, "n": 2}),
        (prompts[2], {"temperature": 0.8, "max_tokens": 13}),
        (prompts[3], {"temperature": 1.0, "max_tokens": 9}),
    ]
    late = (header + tokenizer.encode("late"), {"temperature": 1.0, "max_tokens": 6})

    async def main():
        tasks = [asyncio.create_task(_run(engine, p, ignore_eos=True, **kw)) for p, kw in jobs]
        await asyncio.sleep(0.05)  # all four are queued before the loop starts: one prefill batch
        engine.start()
        joining = asyncio.create_task(_run(engine, late[0], 0.01, ignore_eos=True, **late[1]))
        return await asyncio.gather(*tasks, joining)

    try:
        results = asyncio.run(main())
    finally:
        engine.stop()
    assert engine.num_shared_prefix_tokens == expected_shared * (len(jobs) - 1)
    for (prompt, kw), choices in zip([*jobs, late], results, strict=True):
        assert len(choices) == kw.get("n", 1)
        for choice in choices:
            assert len(choice["ids"]) == kw["max_tokens"]
            assert _max_error(model, prompt, choice, kw["temperature"]) < TOL
            if kw["temperature"] == 0:
                ref = _reference_logprobs(model, prompt, choice["ids"], 0.0)
                assert choice["ids"] == ref.argmax(-1).tolist()


def test_greedy_matches_transformers_generate(tiny):
    model, tokenizer = tiny
    prompt = tokenizer.encode("What is 12 + 30? Answer:")
    engine = _engine(model, tokenizer)
    try:
        (choice,) = asyncio.run(_run(engine, prompt, temperature=0.0, max_tokens=12))
    finally:
        engine.stop()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)
    assert choice["ids"] == out[0, len(prompt) :].tolist()


def test_seeded_request_is_reproducible_under_load(tiny):
    model, tokenizer = tiny
    prompt = tokenizer.encode("Repeat the word test")
    engine = _engine(model, tokenizer)

    async def loaded():
        others = [
            _run(engine, tokenizer.encode("x" * (i + 1)), 0.0, max_tokens=15, ignore_eos=True)
            for i in range(5)
        ]
        mine = _run(engine, prompt, 0.003, temperature=1.0, seed=1234, max_tokens=15, ignore_eos=True)
        return (await asyncio.gather(mine, *others))[0]

    try:
        (alone,) = asyncio.run(
            _run(engine, prompt, temperature=1.0, seed=1234, max_tokens=15, ignore_eos=True)
        )
        (busy,) = asyncio.run(loaded())
    finally:
        engine.stop()
    assert alone["ids"] == busy["ids"]


def _perturbed_state_dict(model) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


def test_weight_swap_waits_for_running_requests(tiny):
    from transformers import AutoModelForCausalLM

    model, tokenizer = tiny
    served = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    served.load_state_dict(model.state_dict())
    new_weights = _perturbed_state_dict(model)
    reference_new = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    reference_new.load_state_dict(new_weights)
    prompt = tokenizer.encode("Compute the sum of 3 and 4")
    engine = _engine(served, tokenizer)
    order: list[str] = []

    async def main():
        running = asyncio.Event()

        async def long_request():
            request = GenerationRequest(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
            ids, logprobs = [], []
            async for updates in engine.generate(request):
                running.set()
                ids += updates[0].token_ids
                logprobs += updates[0].logprobs
            order.append("long done")
            return {"ids": ids, "logprobs": logprobs}

        async def swap():
            await running.wait()
            order.append("swap requested")
            await engine.update_weights(new_weights)
            order.append("swapped")

        async def late_request():  # arrives while the swap is pending: must see the new weights
            await running.wait()
            await asyncio.sleep(0)
            (choice,) = await _run(engine, prompt, temperature=1.0, max_tokens=10, ignore_eos=True)
            return choice

        old, _, new = await asyncio.gather(long_request(), swap(), late_request())
        return old, new

    try:
        old_choice, new_choice = asyncio.run(main())
        # back to the weights loaded at start
        asyncio.run(engine.update_weights(None))
        (base_again,) = asyncio.run(_run(engine, prompt, temperature=1.0, max_tokens=6))
    finally:
        engine.stop()
    assert order == ["swap requested", "long done", "swapped"]
    assert _max_error(model, prompt, old_choice, 1.0) < TOL  # all 40 tokens on the old weights
    assert _max_error(reference_new, prompt, new_choice, 1.0) < TOL
    assert _max_error(model, prompt, new_choice, 1.0) > 1e-2  # the swap really changed something
    assert _max_error(model, prompt, base_again, 1.0) < TOL


def test_check_state_dict_names_the_problem(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, max_model_len=64)
    good = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    engine.check_state_dict(good)  # tied lm_head may be absent
    with pytest.raises(ValueError, match="missing keys"):
        engine.check_state_dict({k: v for k, v in good.items() if k != "model.norm.weight"})
    with pytest.raises(ValueError, match="unexpected keys"):
        engine.check_state_dict({**good, "extra.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="shape mismatches"):
        engine.check_state_dict({**good, "model.norm.weight": torch.zeros(3)})


def test_check_request_rejects_bad_input(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, max_model_len=64, max_num_seqs=4)
    cases = {
        "empty": GenerationRequest([], SamplingParams(max_tokens=1)),
        "ids must be in": GenerationRequest([1, 100000], SamplingParams(max_tokens=1)),
        "maximum context length is 64": GenerationRequest([1] * 60, SamplingParams(max_tokens=5)),
        r"n must be in \[1, 4\]": GenerationRequest([1], SamplingParams(max_tokens=1, n=5)),
        "stop_token_ids": GenerationRequest([1], SamplingParams(max_tokens=1, stop_token_ids=(-1,))),
    }
    for message, request in cases.items():
        with pytest.raises(ValueError, match=message):
            engine.check_request(request)


def test_cancelled_request_frees_its_slot(tiny):
    model, tokenizer = tiny
    engine = _engine(model, tokenizer, max_num_seqs=1)

    async def main():
        stream = engine.generate(
            GenerationRequest([1, 2, 3], SamplingParams(max_tokens=900, ignore_eos=True))
        )
        await stream.__anext__()
        await stream.aclose()  # the client went away
        return await asyncio.wait_for(_run(engine, [4, 5], max_tokens=3), timeout=60)

    try:
        (choice,) = asyncio.run(main())
    finally:
        engine.stop()
    assert len(choice["ids"]) == 3


def test_non_finite_logits_fail_the_request_instead_of_returning_nan_logprobs(tiny):
    from transformers import AutoModelForCausalLM

    from prime_composer.inference.requests import EngineError

    model, tokenizer = tiny
    broken = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["model.norm.weight"][0] = float("nan")  # what an unchecked weight update would do
    broken.load_state_dict(state)
    engine = _engine(broken, tokenizer)
    try:
        with pytest.raises(EngineError, match="non-finite logits"):
            asyncio.run(_run(engine, [1, 2, 3], max_tokens=4))
        # The loop survives: the server keeps serving (other weights would work again).
        asyncio.run(engine.update_weights(model.state_dict()))
        (choice,) = asyncio.run(_run(engine, [1, 2, 3], max_tokens=4, ignore_eos=True))
    finally:
        engine.stop()
    assert _max_error(model, [1, 2, 3], choice, 1.0) < TOL

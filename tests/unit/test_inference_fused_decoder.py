"""The fused, prepacked decoder layers (inference/hf/fused_decoder.py) against an independent forward.

The reference is a second model holding the same weights, loaded with transformers' ``eager``
attention and run over each whole sequence at once (no cache, no padding). The fused side runs
the way the decode loop does: one left-padded prefill of rows of different lengths, then decode
steps of one token per row, greedy. Small random Llama, Qwen2 (biases) and Qwen3 (q/k norms)
models, with random norm weights and biases so that every parameter matters.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from prime_composer.inference.hf import attention
from prime_composer.inference.hf.fused_decoder import fused_decoder
from prime_composer.inference.hf.kv_cache import BatchKVCache
from prime_composer.inference.hf.output_head import packed_output_head

TOL = 1e-4
PROMPTS = [[5, 17, 3, 99, 42, 8, 1], [7, 7, 120], [64, 2, 31, 77, 5]]


def _config(arch: str, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    options = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 256,
        "tie_word_embeddings": arch != "llama",
        **overrides,
    }
    return cls(**options)


def _models(arch: str, **overrides):
    """(served, reference): the same random weights, our attention kernel vs transformers' eager."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _config(arch, **overrides)
    served = AutoModelForCausalLM.from_config(config, attn_implementation=attention.register()).eval()
    with torch.no_grad():
        for name, param in served.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.normal_(1.0, 0.2)
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    reference.load_state_dict(served.state_dict())
    return served, reference


def _fused_greedy(
    served, decoder, prompts: list[list[int]], steps: int
) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens per row and the logits ``[steps + 1, rows, vocab]`` they were picked from."""
    head = packed_output_head(served)
    assert head is not None
    length = max(len(p) for p in prompts)
    starts = torch.tensor([length - len(p) for p in prompts])
    ids = torch.tensor([[0] * (length - len(p)) + p for p in prompts])
    q = torch.arange(length)
    causal = q.unsqueeze(0) <= q.unsqueeze(1)
    key_is_real = q.unsqueeze(0) >= starts.unsqueeze(1)
    query_is_pad = q.unsqueeze(0) < starts.unsqueeze(1)
    allowed = causal.unsqueeze(0) & (key_is_real.unsqueeze(1) | query_is_pad.unsqueeze(2))
    positions = (q.unsqueeze(0) - starts.unsqueeze(1)).clamp(min=0)
    cache = BatchKVCache(served.config.num_hidden_layers)
    tokens: list[list[int]] = [[] for _ in prompts]
    all_logits = []
    with torch.inference_mode():
        logits = head(decoder(ids, positions, allowed.unsqueeze(1), cache))
        for step in range(steps + 1):
            all_logits.append(logits)
            picked = logits.argmax(-1)
            for row, token in enumerate(picked.tolist()):
                tokens[row].append(token)
            if step == steps:
                break
            columns = torch.arange(cache.length + 1)
            mask = (columns.unsqueeze(0) >= starts.unsqueeze(1))[:, None, None, :]
            logits = head(decoder(picked.unsqueeze(1), (cache.length - starts).unsqueeze(1), mask, cache))
    return tokens, torch.stack(all_logits)


def _reference_logits(reference, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """``[len(completion), vocab]``: the logits that predicted each completion token."""
    with torch.no_grad():
        return reference(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]


def _max_error(reference, tokens, logits) -> float:
    errors = []
    for row, prompt in enumerate(PROMPTS):
        want = _reference_logits(reference, prompt, tokens[row])
        errors.append(((logits[:, row] - want).abs().max() / want.abs().max()).item())
    return max(errors)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_prefill_and_decode_match_an_eager_forward(arch):
    served, reference = _models(arch)
    decoder = fused_decoder(served, rows=4)
    assert decoder is not None  # float32 on CPU, a supported architecture: the fused path is taken
    tokens, logits = _fused_greedy(served, decoder, PROMPTS, steps=6)
    assert _max_error(reference, tokens, logits) < TOL
    for row, prompt in enumerate(PROMPTS):  # greedy: each token is the reference's argmax
        assert tokens[row] == _reference_logits(reference, prompt, tokens[row]).argmax(-1).tolist()


def test_a_weight_written_in_place_is_repacked_before_the_next_call():
    served, reference = _models("qwen2")
    decoder = fused_decoder(served, rows=4)
    assert decoder is not None
    _fused_greedy(served, decoder, PROMPTS, steps=1)  # packed and used
    # An update as the weight swap makes it: copy_ into the live parameters, nothing told.
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in served.state_dict().items() if "layers.1." in k}
    with torch.no_grad():
        params = dict(served.named_parameters())
        for name, value in new.items():
            params[name].copy_(value)
    before = _max_error(reference, *_fused_greedy(served, decoder, PROMPTS, steps=3))
    assert before > 1e-2  # the update changed the outputs: the reference still has the old weights
    reference.load_state_dict(served.state_dict())
    assert _max_error(reference, *_fused_greedy(served, decoder, PROMPTS, steps=3)) < TOL


def test_models_it_does_not_compute_keep_their_own_forward():
    served, _ = _models("llama", hidden_act="gelu")
    assert fused_decoder(served) is None
    served, _ = _models("llama")
    assert fused_decoder(served.to(torch.float64)) is None


def test_the_engine_serves_through_the_fused_layers_and_picks_up_updates():
    import asyncio

    from transformers import AutoTokenizer

    from prime_composer.inference.hf.engine import Engine
    from prime_composer.inference.requests import GenerationRequest, SamplingParams
    from prime_composer.model.resolve import resolve_model_name

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_name("builtin:tiny-qwen3"))
    served, reference = _models("qwen3", vocab_size=len(tokenizer))
    engine = Engine(served, tokenizer, max_model_len=128, max_num_seqs=4)
    assert engine._fused is not None
    prompt = PROMPTS[0]

    async def greedy() -> tuple[list[int], list[float]]:
        request = GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        ids, logprobs = [], []
        async for updates in engine.generate(request):
            ids += updates[0].token_ids
            logprobs += updates[0].logprobs
        return ids, logprobs

    def check(ids: list[int], logprobs: list[float]) -> None:
        want = torch.log_softmax(_reference_logits(reference, prompt, ids), dim=-1)
        assert ids == want.argmax(-1).tolist()
        picked = want.gather(1, torch.tensor(ids).unsqueeze(1)).squeeze(1)
        assert (picked - torch.tensor(logprobs)).abs().max().item() < TOL

    engine.start()
    try:
        check(*asyncio.run(greedy()))
        # A deterministic change, so the tied embedding and output layer get the same new values.
        new = {k: 1.05 * v + 0.01 for k, v in served.state_dict().items()}
        asyncio.run(engine.update_weights(new))
        reference.load_state_dict(new)
        check(*asyncio.run(greedy()))
    finally:
        engine.stop()

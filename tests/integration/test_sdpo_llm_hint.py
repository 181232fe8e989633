"""The LLM hint source against the embedded inference server (tiny model, loopback, in-process).

The tiny model's (seeded) reply is not a useful hint, but the whole path is real: the hint request goes over
HTTP to the OpenAI-compatible chat route, its reply becomes the hint, and the teacher context is the
chat template's rendering with that hint inserted.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from prime_composer.config.inference import InferenceConfig
from prime_composer.config.sdpo import HintConfig
from prime_composer.inference.local import running_server
from prime_composer.model.resolve import resolve_model_name
from prime_composer.orchestrator.record import EpisodeRecord
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.sdpo.hints import HintBuilder
from prime_composer.orchestrator.sdpo.target import sdpo_target

MODEL = "builtin:tiny-qwen3"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    torch.set_num_threads(1)
    config = InferenceConfig(output_dir=tmp_path_factory.mktemp("run"), max_model_len=512, num_threads=1)
    with running_server(config) as url:
        yield url


def test_llm_hint_from_the_embedded_server(server):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_name(MODEL))
    messages = [{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": "8"}]
    prompt = tok.encode(tok.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False))
    completion = [*tok.encode("8"), tok.eos_token_id]
    sample = Sample(
        prompt_ids=prompt,
        completion_ids=completion,
        completion_logprobs=[0.0] * len(completion),
        completion_mask=[1] * len(completion),
        reward=0.0,
        example_id=0,
        group_id=0,
        policy_step=0,
        episode=EpisodeRecord(messages=messages, task={"answer": "7"}),
    )
    cfg = HintConfig(
        enabled=True,
        sources=["llm"],
        llm={
            "base_url": f"{server}/v1",
            "model": MODEL,
            "max_tokens": 8,
            "temperature": 1.0,
            "extra_body": {"seed": 0},
        },
    )
    stats = asyncio.run(HintBuilder(cfg, tok, 256).apply([sample]))
    assert stats.num_llm_errors == 0 and stats.num_hinted == 1, stats
    assert sdpo_target(sample).source == "llm"
    hint = sdpo_target(sample).hint
    assert hint.startswith("Hint: ") and len(hint) > len("Hint: ")
    expected = tok.apply_chat_template(
        [messages[0], {"role": "user", "content": hint}], add_generation_prompt=True, tokenize=False
    )
    assert tok.decode(sdpo_target(sample).teacher_prefix_ids) == expected

"""Prompt preparation off the event loop (inference/preprocess.py).

The direct call into the Rust tokenizer must give exactly the ids the transformers tokenizer gives
(checked against ``tokenizer.encode`` on awkward text); the time limit's two outcomes (413 for a
job that ran too long, 429 for one that never got a thread) are driven by a tokenizer that blocks
on an event, so no test depends on how fast this machine is.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from prime_composer.inference.guard import APIError
from prime_composer.inference.preprocess import Preprocessor, PromptTooLong, _plain_backend
from prime_composer.inference.protocol import ChatCompletionRequest, CompletionRequest
from prime_composer.model.resolve import resolve_model_name

TEXTS = [
    "What is 12 + 30?",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",  # special tokens written as text
    "  leading and   repeated   spaces\t\ttabs\n\n\nnewlines ",
    "naïve café — 東京 🤖 ∑ x²",
    "a" * 3000,
    "",
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_name("builtin:tiny-qwen3"))


@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_direct_rust_call_gives_the_tokenizers_ids(tokenizer, add_special_tokens):
    assert _plain_backend(tokenizer) is not None  # the fast path is the one under test
    preprocess = Preprocessor(tokenizer, max_model_len=10**6)
    for text in TEXTS:
        expected = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        assert preprocess._encode(text, add_special_tokens, "prompt") == expected, text[:40]


def test_too_long_prompt_is_counted_exactly(tokenizer):
    text = "hello world " * 100
    num_tokens = len(tokenizer.encode(text, add_special_tokens=False))
    fits = Preprocessor(tokenizer, max_model_len=num_tokens + 1)  # room for one generated token
    assert len(fits._encode(text, False, "prompt")) == num_tokens
    with pytest.raises(PromptTooLong) as info:
        Preprocessor(tokenizer, max_model_len=num_tokens)._encode(text, False, "prompt")
    assert info.value.num_tokens == num_tokens


def test_chat_is_rendered_by_the_servers_template(tokenizer):
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    body = ChatCompletionRequest(messages=messages)
    ids = asyncio.run(Preprocessor(tokenizer, max_model_len=512).chat(body))
    plain = [{"role": "user", "content": "a\nb"}]
    expected = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    assert ids == tokenizer.encode(expected, add_special_tokens=False)


def test_renderer_options_are_not_template_variables(tokenizer):
    preprocess = Preprocessor(tokenizer, max_model_len=512)
    for name in ("tokenize", "return_dict", "add_generation_prompt", "tools", "truncation"):
        body = ChatCompletionRequest(
            messages=[{"role": "user", "content": "x"}], chat_template_kwargs={name: 1}
        )
        with pytest.raises(APIError, match=name):
            asyncio.run(preprocess.chat(body))
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}],
        chat_template_kwargs={"documents": [], "enable_thinking": 0},
    )
    assert asyncio.run(preprocess.chat(body))


class _BlockingTokenizer:
    """Stands for a tokenizer working on a huge prompt: ``encode`` waits until released."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.num_calls = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.num_calls += 1
        self.started.set()
        assert self.release.wait(timeout=30)
        return [1]


def test_time_limit_is_413_for_a_running_job_and_429_for_a_queued_one():
    slow = _BlockingTokenizer()
    preprocess = Preprocessor(slow, max_model_len=16, num_threads=1, timeout_s=0.2)
    body = CompletionRequest(prompt="huge")

    async def both() -> tuple[APIError, APIError]:
        with pytest.raises(APIError) as running:
            await preprocess.completion_prompts(body)
        assert slow.started.is_set()  # the job is still running on the only thread
        with pytest.raises(APIError) as queued:
            await preprocess.completion_prompts(body)
        return running.value, queued.value

    try:
        running, queued = asyncio.run(both())
    finally:
        slow.release.set()
        preprocess.close()
    assert running.status == 413 and "inference.preprocess_timeout_s = 0.2" in running.message
    assert queued.status == 429 and "busy" in queued.message
    assert slow.num_calls == 1  # the queued job was dropped, never run

"""Incremental detokenization and stop strings, checked against the tokenizer's one-shot decode."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from prime_composer.inference.hf.detokenize import IncrementalDetokenizer
from prime_composer.model.resolve import resolve_model_name


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_name("builtin:tiny-qwen3"))


def _stream(tokenizer, text: str | list[int], **kwargs) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed the tokens one by one, as the decode loop does (flush on the last one)."""
    prompt = tokenizer.encode("What is 1 + 2?")
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True, **kwargs)
    deltas = []
    ids = tokenizer.encode(text) if isinstance(text, str) else text
    for i, token in enumerate(ids):
        detok.add(token)
        final = i == len(ids) - 1 or detok.stop_hit is not None
        if final:
            detok.flush()
        deltas.append(detok.take_delta(final=final))
        if detok.stop_hit is not None:
            break
    return detok, deltas


def test_incremental_text_matches_one_shot_decode(tokenizer):
    # Non-ASCII characters are split into byte tokens by this tokenizer: partial characters
    # must be held back, not emitted as U+FFFD.
    text = "The answer is 42 — héllo wörld ✓<|im_end|> done"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # really several tokens
    detok, deltas = _stream(tokenizer, text)
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == detok.text
    assert all("\ufffd" not in d for d in deltas)


def test_incomplete_last_character_is_kept_like_one_shot_decode(tokenizer):
    ids = tokenizer.encode("ok é")[:-1]  # ends inside the two bytes of "é"
    detok, deltas = _stream(tokenizer, ids)
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert detok.text.endswith("\ufffd") and "".join(deltas) == detok.text


def test_stop_string_cuts_text_and_holds_back_prefix(tokenizer):
    detok, deltas = _stream(tokenizer, "Compute the sum of 12 and 30 Answer: 42 and more", stop=("Answer:",))
    assert detok.stop_hit == "Answer:"
    assert detok.text == "Compute the sum of 12 and 30 "
    assert "".join(deltas) == detok.text
    # no delta ever carried a part of the stop string that was later cut
    assert all("Ans" not in d for d in deltas)


def test_include_stop_and_earliest_of_several(tokenizer):
    detok, _ = _stream(tokenizer, "one two three four", stop=("four", "two"), include_stop=True)
    assert detok.stop_hit == "two"
    assert detok.text == "one two"

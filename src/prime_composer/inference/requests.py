"""What the server hands the decode loop and what it gets back, per request and per choice, and
the ``Decoder`` contract the OpenAI routes serve from (the ``hf`` backend's ``Engine``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from prime_composer.inference.call_grammar import CallSpec


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (already validated by the server)."""

    max_tokens: int
    temperature: float = 1.0
    """0 is greedy; logprobs are ``log_softmax(logits / temperature)`` (see ``sampling``)."""
    top_p: float = 1.0
    n: int = 1
    """Choices sampled from the same prompt (prefilled once)."""
    seed: int | None = None
    """Seeds each choice's own generator; ``None`` draws one from the server's seeded RNG."""
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    num_top_logprobs: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams
    detokenize: bool = True
    """Produce text (chat/completions); token-in requests without stop strings skip it."""
    call: CallSpec | None = None
    """Decode a forced tool call under this grammar (``tool_choice`` required or named)."""


@dataclass
class ChoiceUpdate:
    """What one choice produced in one iteration of the loop (usually one token)."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """Processed logprob of each token (after temperature, before top-p)."""
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    """``stop`` (EOS, a stop token or a stop string) or ``length`` (``max_tokens``)."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the choice (``None`` for EOS), as in vLLM."""


class EngineError(RuntimeError):
    """A request failed inside the decode loop (the server answers 500 and keeps serving)."""


class Decoder(Protocol):
    """A decode loop the OpenAI routes (``openai_routes.py``) generate with."""

    @property
    def max_model_len(self) -> int:
        """Prompt plus completion tokens one sequence may hold."""
        ...

    def check_request(self, request: GenerationRequest) -> None:
        """Raise ``ValueError`` for a request this decoder cannot run (before it is queued)."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[list[ChoiceUpdate]]:
        """The request's updates, one list per iteration of the loop, until every choice finishes."""
        ...

"""Request schemas of the OpenAI-compatible API, with vLLM's extensions, and their validation.

Field names and meanings follow vLLM's OpenAI server (``return_token_ids``,
``return_tokens_as_token_ids``, ``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``, ...) so
clients talk to either backend the same way. Rules:

- sampling values are finite and in range: ``temperature`` 0 (greedy) or in
  [``MIN_TEMPERATURE``, ``MAX_TEMPERATURE``] (below the minimum, ``logits / T`` leaves float32 and
  logprobs become NaN; above the maximum sampling is uniform noise), ``top_p`` in (0, 1], ``seed``
  a 64-bit integer, stop strings non-empty (an empty one matches everywhere); ``Infinity`` and
  ``NaN``, which Python's JSON parser accepts, are refused like any other out-of-range value;
- a sampling option this backend does not implement is accepted only at its neutral value
  (``top_k`` 0/-1, ``repetition_penalty`` 1, ...); any other value is a 400 naming it, never
  silently ignored;
- ``stream_options`` only with ``stream = true`` (as OpenAI and vLLM); ``include_usage`` asks for
  the final usage chunk;
- fields that do not change the output (``conformance.IGNORED_FIELDS``: ``user``, ``metadata``,
  ``priority``, ``cache_salt``, ...) are accepted and ignored; any other unknown field of a chat or
  text completion is a 400 naming it (OpenAI refuses them too; vLLM would drop them with a
  warning). The token-in ``/inference/v1/generate`` keeps vLLM's leniency (warned once).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, model_validator

from prime_composer.inference.conformance import unknown_fields_error
from prime_composer.inference.requests import SamplingParams

logger = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20
MIN_TEMPERATURE = 1e-5
"""Smallest non-zero temperature (vLLM treats anything below it as greedy; here it is refused)."""
MAX_TEMPERATURE = 100.0
_warned_fields: set[str] = set()


def _usable_temperature(value: float) -> float:
    if 0 < value < MIN_TEMPERATURE:
        raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}")
    return value


def _non_empty_stops(value: str | list[str] | None) -> str | list[str] | None:
    stops = [value] if isinstance(value, str) else value or []
    if any(s == "" for s in stops):
        raise ValueError("stop strings must be non-empty (an empty one would match at once)")
    return value


Temperature = Annotated[
    float, Field(ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False), AfterValidator(_usable_temperature)
]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=-(2**63), lt=2**64)]
Stop = Annotated[str | list[str] | None, AfterValidator(_non_empty_stops)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    """Send one last chunk with ``usage`` (and no choices) before ``data: [DONE]``."""
    continuous_usage_stats: bool = False
    """vLLM's usage in every chunk: not implemented by the hf backend (refused when true)."""


class _Lenient(BaseModel):
    """Unknown fields are kept (and warned about once per name) instead of failing the request."""

    model_config = ConfigDict(extra="allow")

    def warn_unknown(self) -> None:
        for name in self.model_extra or {}:
            if name not in _warned_fields:
                _warned_fields.add(name)
                logger.warning("ignoring unsupported request field %r (warned once)", name)

    def refuse_unknown(self) -> None:
        """A 400 for a field that is neither implemented nor in ``conformance.IGNORED_FIELDS``."""
        error = unknown_fields_error(self.model_extra or {}, ())
        if error is not None:
            raise error


class _SamplingFields(_Lenient):
    """Options common to chat and text completions."""

    model: str | None = None
    n: int = Field(default=1, ge=1)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    stop: Stop = None
    stop_token_ids: list[int] | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    user: str | None = None
    # Neutral values only (checked in neutral_options_error):
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0

    @model_validator(mode="after")
    def _check_stream_options(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream = true")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise ValueError("stream_options.continuous_usage_stats is not supported by the hf backend")
        return self

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (OpenAI: only when asked for)."""
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_SamplingFields):
    messages: list[Any]
    """Chat messages; their shape is checked with the rendering, on the preprocessing threads
    (validating a million dicts here would hold the event loop for a second)."""
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    """A Jinja template to render this request with: refused unless the server allows it
    (``inference.allow_client_chat_template``)."""
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    prompt: Annotated[
        list[StrictInt] | list[list[StrictInt]] | str | list[str], Field(union_mode="left_to_right")
    ]
    """Text, texts, token ids, or lists of token ids. Tried in that order (token ids first, ints
    strictly, so ``["5"]`` stays text): pydantic's default "smart" union validates every member and
    collects an error per element of the ones that fail, ~0.4 s on the event loop for a million ids."""
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True


class GenerateSamplingParams(BaseModel):
    """vLLM's ``SamplingParams`` as sent to ``/inference/v1/generate`` (unknown keys are errors)."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(default=1, ge=1)
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    max_tokens: int | None = Field(default=None, ge=1)
    seed: Seed | None = None
    stop: Stop = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    routed_experts_prompt_start: int | None = None
    """Where MoE routing data should start (sent by verifiers' train client when it bridges
    turns); this backend returns no routing data, so it has nothing to apply it to."""
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_tokens: int = 0
    prompt_logprobs: int | None = None


class GenerateRequest(_Lenient):
    """vLLM's token-in, token-out request (``POST /inference/v1/generate``)."""

    token_ids: list[StrictInt]
    sampling_params: GenerateSamplingParams = GenerateSamplingParams()
    model: str | None = None
    request_id: str | None = None
    stream: bool = False
    cache_salt: str | None = None
    priority: int = 0
    features: dict[str, Any] | None = None


def neutral_options_error(options: BaseModel) -> str | None:
    """A message naming the first non-neutral unsupported option, or ``None`` if all are neutral."""
    checks = [
        ("top_k", getattr(options, "top_k", None), (None, 0, -1)),
        ("min_p", getattr(options, "min_p", None), (None, 0.0)),
        ("repetition_penalty", getattr(options, "repetition_penalty", None), (None, 1.0)),
        ("presence_penalty", getattr(options, "presence_penalty", None), (None, 0.0)),
        ("frequency_penalty", getattr(options, "frequency_penalty", None), (None, 0.0)),
        ("logit_bias", getattr(options, "logit_bias", None) or None, (None,)),
        ("min_tokens", getattr(options, "min_tokens", 0), (0,)),
        ("prompt_logprobs", getattr(options, "prompt_logprobs", None), (None,)),
    ]
    for name, value, neutral in checks:
        if value not in neutral:
            return (
                f"{name} = {value!r} is not supported by the hf backend (it would change the sampled "
                "distribution away from the logprobs the trainer recomputes); leave it unset"
            )
    return None


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def sampling_params(
    options: _SamplingFields | GenerateSamplingParams,
    max_tokens: int,
    num_top_logprobs: int,
) -> SamplingParams:
    """Engine sampling params from a validated request (OpenAI defaults: temperature 1, top_p 1)."""
    temperature = options.temperature if options.temperature is not None else 1.0
    top_p = options.top_p if options.top_p is not None else 1.0
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        n=options.n,
        seed=options.seed,
        stop=stop_strings(options.stop),
        stop_token_ids=tuple(options.stop_token_ids or ()),
        ignore_eos=options.ignore_eos,
        num_top_logprobs=num_top_logprobs,
        skip_special_tokens=options.skip_special_tokens,
        include_stop_str_in_output=options.include_stop_str_in_output,
    )

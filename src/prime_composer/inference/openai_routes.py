"""The generation endpoints: ``/v1/chat/completions``, ``/v1/completions`` and vLLM's token-in
``/inference/v1/generate`` (what verifiers' train client and ``renderers`` call).

Response shapes follow vLLM's: with ``return_token_ids`` a chat response has top-level
``prompt_token_ids`` and per-choice ``token_ids`` (in a stream: ``prompt_token_ids`` on the first
chunk, delta ``token_ids`` on each); ``choices[i].logprobs.content[j].logprob`` is the processed
(post-temperature) logprob of the sampled token; with ``return_tokens_as_token_ids`` tokens are
written ``"token_id:<id>"``. The token-in endpoint always writes tokens that way. Logprobs are
clamped at -9999.0 as vLLM does (JSON has no -inf). Streams end with ``data: [DONE]``, preceded by
a chunk carrying ``usage`` (and no choices) only when ``stream_options.include_usage`` is true, as
OpenAI specifies.

Prompts are rendered and tokenized by ``preprocess.Preprocessor`` on its thread pool, never on
the event loop.

Tool calls (``tools``, ``tool_choice``; ``tools.py`` has the rules): a parsed choice's message has
``tool_calls`` (``content`` is ``null`` when the reply was only calls) and the choice
``num_malformed_tool_calls``. Streamed, content flows as it is generated except text that may
still become a call; a call is sent once it is complete, as two deltas of ``delta.tool_calls``
with its ``index``: ``id``, ``type`` and ``function.name`` (``arguments`` empty) first, then
``function.arguments``. A streamed reply therefore adds up to exactly the non-streamed one.
Requests are held to OpenAI's rules (``conformance``: unknown fields, tool names and schemas,
``tool`` messages answering calls); a forced call is decoded under its grammar
(``GenerationRequest.call``); a call of a function not in ``tools`` is content, flagged by
``finish_reason = "unknown_tool_call"`` and ``num_unknown_tool_calls``.

Not implemented (said so at run time, never silently): parsing reasoning out of chat replies,
structured outputs, penalties, ``top_k``/``min_p``, ``echo``, multimodal input.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from prime_composer.inference.guard import APIError
from prime_composer.inference.preprocess import Preprocessor
from prime_composer.inference.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    neutral_options_error,
    sampling_params,
)
from prime_composer.inference.requests import ChoiceUpdate, Decoder, GenerationRequest
from prime_composer.inference.tools import ReplyReader, ToolCallStats, ToolPlan, plan_tools
from prime_composer.tool_calls import DEFAULT_PARSER

logger = logging.getLogger(__name__)

LOGPROB_FLOOR = -9999.0


@dataclass
class ServingState:
    """What the routes need: the decoder (the ``hf`` backend's ``Engine``), the tokenizer, the
    preprocessor and the served model's identity."""

    engine: Decoder
    tokenizer: Any
    served_model_name: str
    model_root: str
    preprocess: Preprocessor | None = None
    """Renders and tokenizes prompts; ``None`` makes one with the default limits."""
    tool_call_parser: str | None = DEFAULT_PARSER
    """The ``tool_calls`` format replies to requests with tools are parsed with (``None``: none)."""
    tool_stats: ToolCallStats = field(default_factory=ToolCallStats)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if self.preprocess is None:
            self.preprocess = Preprocessor(self.tokenizer, max_model_len=self.engine.max_model_len)


@dataclass
class _Choice:
    """A finished choice, accumulated from its updates."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, update: ChoiceUpdate) -> None:
        self.token_ids += update.token_ids
        self.logprobs += update.logprobs
        self.top_logprobs += update.top_logprobs
        self.text += update.text
        self.finish_reason = update.finish_reason or self.finish_reason
        self.stop_reason = update.stop_reason if update.finish_reason else self.stop_reason


def openai_router(state: ServingState) -> APIRouter:
    router = APIRouter()
    engine, tokenizer, preprocess = state.engine, state.tokenizer, state.preprocess
    assert preprocess is not None  # set by ServingState.__post_init__

    def check_model(model: str | None) -> None:
        if model is not None and model != state.served_model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves `{state.served_model_name}`",
                "NotFoundError",
            )

    def submit_checks(request: GenerationRequest) -> None:
        try:
            engine.check_request(request)
        except ValueError as e:
            raise APIError(400, str(e)) from e

    def default_max_tokens(prompt_ids: list[int]) -> int:
        remaining = engine.max_model_len - len(prompt_ids)
        if remaining < 1:
            raise APIError(
                400,
                f"this model's maximum context length is {engine.max_model_len} tokens and the prompt "
                f"has {len(prompt_ids)}: no room to generate; shorten the prompt",
            )
        return remaining

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": state.served_model_name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "prime-composer",
                    "root": state.model_root,
                    "max_model_len": engine.max_model_len,
                }
            ],
        }

    @router.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest) -> Any:
        body.refuse_unknown()
        check_model(body.model)
        _check_options(body)
        if body.continue_final_message and body.add_generation_prompt:
            raise APIError(400, "continue_final_message needs add_generation_prompt = false")
        if body.response_format not in (None, {"type": "text"}):
            raise APIError(400, "response_format other than text is not supported by the hf backend")
        plan = plan_tools(body, state.tool_call_parser)
        prompt_ids = await preprocess.chat(body, plan.reply_prefix, plan.function)
        max_tokens = body.max_completion_tokens or body.max_tokens or default_max_tokens(prompt_ids)
        num_top = (body.top_logprobs or 0) if body.logprobs else 0
        call = plan.call_spec(body.tools) if body.tools else None  # checked by the rendering
        request = GenerationRequest(prompt_ids, sampling_params(body, max_tokens, num_top), call=call)
        submit_checks(request)
        formatter = _ChatFormat(state, body, prompt_ids, plan)
        if body.stream:
            return _sse(formatter.stream(engine.generate(request)))
        choices = await _collect(engine.generate(request), request.params.n)
        return formatter.response(choices)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Any:
        body.refuse_unknown()
        check_model(body.model)
        _check_options(body)
        if body.echo or body.suffix:
            raise APIError(400, "echo and suffix are not supported by the hf backend")
        prompts = await preprocess.completion_prompts(body)
        num_top = body.logprobs if body.logprobs is not None else 0
        requests = []
        for prompt_ids in prompts:
            max_tokens = body.max_tokens if body.max_tokens is not None else 16  # OpenAI/vLLM default
            request = GenerationRequest(prompt_ids, sampling_params(body, max_tokens, num_top))
            submit_checks(request)
            requests.append(request)
        formatter = _CompletionFormat(state, body)
        if body.stream:
            if len(requests) != 1:
                raise APIError(400, "streaming supports one prompt per request")
            return _sse(formatter.stream(engine.generate(requests[0]), requests[0].prompt_ids))
        results = await asyncio.gather(*(_collect(engine.generate(r), r.params.n) for r in requests))
        return formatter.response(list(zip(requests, results, strict=True)))

    @router.post("/inference/v1/generate")
    async def generate(body: GenerateRequest) -> Any:
        body.warn_unknown()
        check_model(body.model)
        params = body.sampling_params
        _check_options(params)
        if body.stream:
            raise APIError(400, "stream = true is not supported on /inference/v1/generate by the hf backend")
        if body.features is not None:
            raise APIError(400, "multimodal features are not supported by the hf backend")
        max_tokens = params.max_tokens or default_max_tokens(body.token_ids)
        num_top = params.logprobs or 0
        request = GenerationRequest(
            list(body.token_ids), sampling_params(params, max_tokens, num_top), detokenize=False
        )
        submit_checks(request)
        choices = await _collect(engine.generate(request), request.params.n)
        num_completion = sum(len(c.token_ids) for c in choices)
        return {
            "request_id": body.request_id or f"generate-tokens-{uuid.uuid4().hex}",
            "choices": [
                {
                    "index": c.index,
                    "logprobs": _chat_logprobs(tokenizer, c.token_ids, c.logprobs, c.top_logprobs, True)
                    if params.logprobs is not None
                    else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    "token_ids": c.token_ids,
                }
                for c in choices
            ],
            "prompt_token_ids": request.prompt_ids,
            "usage": _usage(len(request.prompt_ids), num_completion),
        }

    return router


def _check_options(options: Any) -> None:
    message = neutral_options_error(options)
    if message:
        raise APIError(400, message)


async def _collect(updates: AsyncIterator[list[ChoiceUpdate]], n: int) -> list[_Choice]:
    choices = [_Choice(index=i) for i in range(n)]
    async with aclosing(updates) as stream:  # type: ignore[type-var]
        async for batch in stream:
            for update in batch:
                choices[update.index].add(update)
    return choices


def _usage(num_prompt: int, num_completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
    }


def _token_text(tokenizer: Any, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else tokenizer.decode([token_id])


def _chat_logprobs(
    tokenizer: Any,
    token_ids: list[int],
    logprobs: list[float],
    top_logprobs: list[list[tuple[int, float]]],
    as_ids: bool,
) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = _token_text(tokenizer, token_id, as_ids)
        return {
            "token": text,
            "logprob": max(logprob, LOGPROB_FLOOR),
            "bytes": list(text.encode("utf-8", errors="replace")),
        }

    content = []
    for token_id, logprob, top in zip(token_ids, logprobs, top_logprobs, strict=True):
        item = entry(token_id, logprob)
        item["top_logprobs"] = [entry(t, lp) for t, lp in top]
        content.append(item)
    return {"content": content}


def _completion_logprobs(
    tokenizer: Any,
    token_ids: list[int],
    logprobs: list[float],
    top_logprobs: list[list[tuple[int, float]]],
    as_ids: bool,
    text_offset: int,
) -> dict[str, Any]:
    tokens = [_token_text(tokenizer, t, as_ids) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    tops = []
    for token, logprob, top in zip(tokens, logprobs, top_logprobs, strict=True):
        step = {token: max(logprob, LOGPROB_FLOOR)}
        step.update({_token_text(tokenizer, t, as_ids): max(lp, LOGPROB_FLOOR) for t, lp in top})
        tops.append(step)
    return {
        "text_offset": offsets,
        "token_logprobs": [max(lp, LOGPROB_FLOOR) for lp in logprobs],
        "tokens": tokens,
        "top_logprobs": tops,
    }


def _sse(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        async with aclosing(events) as stream:  # type: ignore[type-var]
            try:
                async for event in stream:
                    yield f"data: {json.dumps(event)}\n\n"
            except Exception as e:  # headers are sent: report in-band, as vLLM does
                error = {"error": {"message": str(e), "type": type(e).__name__, "code": 500}}
                yield f"data: {json.dumps(error)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


class _ChatFormat:
    """Builds chat responses and stream chunks for one request."""

    def __init__(
        self, state: ServingState, body: ChatCompletionRequest, prompt_ids: list[int], plan: ToolPlan
    ) -> None:
        self.state, self.body, self.prompt_ids, self.plan = state, body, prompt_ids, plan
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _logprobs(self, c: _Choice | ChoiceUpdate) -> dict[str, Any] | None:
        if not self.body.logprobs:
            return None
        as_ids = self.body.return_tokens_as_token_ids
        return _chat_logprobs(self.state.tokenizer, c.token_ids, c.logprobs, c.top_logprobs, as_ids)

    def _choice(self, c: _Choice) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        choice: dict[str, Any] = {"index": c.index, "message": message}
        finish_reason = c.finish_reason
        if self.plan.parser is not None:
            reader = self.plan.reader()
            reply = reader.feed(c.text, final=True)
            self.state.tool_stats.record(reader)
            message["content"] = reply.content or (None if reply.tool_calls else "")
            if reply.tool_calls:
                message["tool_calls"] = [call.to_openai() for call in reply.tool_calls]
            finish_reason = self.plan.finish_reason(c.finish_reason, reader.num_calls, reader.num_unknown)
            choice["num_malformed_tool_calls"] = reader.num_malformed
            choice["num_unknown_tool_calls"] = reader.num_unknown
        choice.update(logprobs=self._logprobs(c), finish_reason=finish_reason, stop_reason=c.stop_reason)
        if self.body.return_token_ids:
            choice["token_ids"] = c.token_ids
        return choice

    def response(self, choices: list[_Choice]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.state.served_model_name,
            "choices": [self._choice(c) for c in choices],
            "usage": _usage(len(self.prompt_ids), sum(len(c.token_ids) for c in choices)),
        }
        if self.body.return_token_ids:
            out["prompt_token_ids"] = self.prompt_ids
        return out

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.state.served_model_name,
            "choices": choices,
            **extra,
        }

    async def stream(self, updates: AsyncIterator[list[ChoiceUpdate]]) -> AsyncIterator[dict[str, Any]]:
        first = [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(self.body.n)
        ]
        extra = {"prompt_token_ids": self.prompt_ids} if self.body.return_token_ids else {}
        yield self._chunk(first, **extra)
        readers = [self.plan.reader() for _ in range(self.body.n)] if self.plan.parser is not None else None
        num_completion = 0
        async with aclosing(updates) as stream:  # type: ignore[type-var]
            async for batch in stream:
                for u in batch:
                    num_completion += len(u.token_ids)
                    if readers is None:
                        choices = [self._delta(u, {"content": u.text}, u.finish_reason)]
                    else:
                        choices = self._tool_deltas(readers[u.index], u)
                    for choice in choices:
                        yield self._chunk([choice])
        if self.body.include_usage:
            yield self._chunk([], usage=_usage(len(self.prompt_ids), num_completion))

    def _delta(
        self, u: ChoiceUpdate | None, delta: dict[str, Any], finish_reason: str | None, index: int = 0
    ) -> dict[str, Any]:
        """One choice of a chunk; ``u`` is the engine update whose tokens it carries (``None``: a
        chunk that only adds a call's arguments)."""
        choice: dict[str, Any] = {
            "index": u.index if u is not None else index,
            "delta": delta,
            "logprobs": self._logprobs(u) if u is not None else None,
            "finish_reason": finish_reason,
            "stop_reason": u.stop_reason if u is not None and finish_reason is not None else None,
        }
        if self.body.return_token_ids:
            choice["token_ids"] = u.token_ids if u is not None else []
        return choice

    def _tool_deltas(self, reader: ReplyReader, u: ChoiceUpdate) -> list[dict[str, Any]]:
        """The chunks of one update of a parsed choice: its content and tokens, then two deltas per
        call it completed; the last one carries the finish reason."""
        final = u.finish_reason is not None
        reply = reader.feed(u.text, final)
        finish_reason = (
            self.plan.finish_reason(u.finish_reason, reader.num_calls, reader.num_unknown) if final else None
        )
        first_index = reader.num_calls - len(reply.tool_calls)
        delta: dict[str, Any] = {"content": reply.content} if reply.content else {}
        if reply.tool_calls:
            delta["tool_calls"] = [
                {
                    "index": first_index + k,
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": ""},
                }
                for k, c in enumerate(reply.tool_calls)
            ]
        choices = [self._delta(u, delta, None if reply.tool_calls else finish_reason)]
        for k, call in enumerate(reply.tool_calls):
            arguments = {
                "tool_calls": [{"index": first_index + k, "function": {"arguments": call.arguments}}]
            }
            last = k == len(reply.tool_calls) - 1
            choices.append(self._delta(None, arguments, finish_reason if last else None, index=u.index))
        if final:
            choices[-1]["stop_reason"] = u.stop_reason
            choices[-1]["num_malformed_tool_calls"] = reader.num_malformed
            choices[-1]["num_unknown_tool_calls"] = reader.num_unknown
            self.state.tool_stats.record(reader)
        return choices


class _CompletionFormat:
    """Builds text-completion responses and stream chunks for one request."""

    def __init__(self, state: ServingState, body: CompletionRequest) -> None:
        self.state, self.body = state, body
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _logprobs(self, c: _Choice | ChoiceUpdate, text_offset: int) -> dict[str, Any] | None:
        if self.body.logprobs is None:
            return None
        as_ids = self.body.return_tokens_as_token_ids
        return _completion_logprobs(
            self.state.tokenizer, c.token_ids, c.logprobs, c.top_logprobs, as_ids, text_offset
        )

    def response(self, results: list[tuple[GenerationRequest, list[_Choice]]]) -> dict[str, Any]:
        choices = []
        num_prompt = num_completion = 0
        for prompt_index, (request, prompt_choices) in enumerate(results):
            num_prompt += len(request.prompt_ids)
            for c in prompt_choices:
                num_completion += len(c.token_ids)
                choice: dict[str, Any] = {
                    "index": prompt_index * request.params.n + c.index,
                    "text": c.text,
                    "logprobs": self._logprobs(c, 0),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                if self.body.return_token_ids:
                    choice["prompt_token_ids"] = request.prompt_ids
                    choice["token_ids"] = c.token_ids
                choices.append(choice)
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.state.served_model_name,
            "choices": choices,
            "usage": _usage(num_prompt, num_completion),
        }

    async def stream(
        self, updates: AsyncIterator[list[ChoiceUpdate]], prompt_ids: list[int]
    ) -> AsyncIterator[dict[str, Any]]:
        num_completion = 0
        offsets = [0] * self.body.n
        sent_prompt = [False] * self.body.n
        async with aclosing(updates) as stream:  # type: ignore[type-var]
            async for batch in stream:
                for u in batch:
                    num_completion += len(u.token_ids)
                    choice: dict[str, Any] = {
                        "index": u.index,
                        "text": u.text,
                        "logprobs": self._logprobs(u, offsets[u.index]),
                        "finish_reason": u.finish_reason,
                        "stop_reason": u.stop_reason,
                    }
                    offsets[u.index] += len(u.text)
                    if self.body.return_token_ids:
                        if not sent_prompt[u.index]:
                            choice["prompt_token_ids"] = prompt_ids
                            sent_prompt[u.index] = True
                        choice["token_ids"] = u.token_ids
                    yield self._chunk([choice])
        if self.body.include_usage:
            yield self._chunk([], usage=_usage(len(prompt_ids), num_completion))

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.state.served_model_name,
            "choices": choices,
            **extra,
        }

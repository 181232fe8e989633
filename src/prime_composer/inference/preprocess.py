"""Turning a request into prompt token ids, off the event loop and within a time limit.

Rendering a chat template and tokenizing take time proportional to the prompt (a 4 MB prompt
takes 5-10 s to tokenize on one core). On the event loop that stalls every other request,
``/health`` included, so here they run on a small thread pool (``num_threads``); the Rust
tokenizer releases the GIL while it works, and Jinja is Python code that yields the GIL every few
milliseconds, so the event loop keeps answering.

Rules (each refusal is an ``APIError`` naming the field):

- a chat template sent by the client (``chat_template``, top level or in
  ``chat_template_kwargs``) is refused unless ``allow_client_template``: a template is a program
  the server runs. ``chat_template_kwargs`` holds template variables (``enable_thinking``, ...);
  ``apply_chat_template``'s own options (``tokenize``, ``return_dict``, ...) are refused;
- messages are objects with a string ``role`` and a string, null (rendered as ``""``, as vLLM
  does) or list-of-text-parts ``content``; ``tools`` and the ``tool_calls`` of assistant messages
  are checked and put in the form chat templates expect (``tools.template_tools``,
  ``tools.template_message``), with OpenAI's rules on tool names, schemas and which call each
  ``tool`` message answers (``conformance``); all on a worker thread, not by the request schema;
- a request with ``tools`` for a template that never reads them is refused (they would be dropped);
- a reply prefix (``tool_choice`` required or named: ``tools.ToolPlan.reply_prefix``) is appended
  to the rendered text before tokenizing, so the prompt ids end with it;
- text must be valid Unicode (a lone surrogate such as ``\\ud800`` is a 400, not a tokenizer crash);
- a prompt longer than the context is refused as soon as its length is known, before its ids
  become a Python list (that conversion holds the GIL, ~70 ms per million tokens);
- the whole job, waiting for a thread included, has ``timeout_s``. Past it the request is a 413
  when its job was running (the prompt is too large to prepare in time) or a 429 when it never
  got a thread (the pool is busy; retry). A running job cannot be interrupted: it finishes in the
  background and its result is dropped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from prime_composer.inference.conformance import check_tool_messages
from prime_composer.inference.guard import APIError
from prime_composer.inference.protocol import ChatCompletionRequest, CompletionRequest
from prime_composer.inference.tools import template_message, template_reads_tools, template_tools

T = TypeVar("T")

_TEMPLATE_VARIABLE_PARAMS = {"documents"}
"""``apply_chat_template`` parameters that are really template variables (allowed in kwargs)."""


class PromptTooLong(Exception):
    """A prompt has more tokens than the context holds (raised in a worker thread)."""

    def __init__(self, num_tokens: int) -> None:
        super().__init__(num_tokens)
        self.num_tokens = num_tokens


class Preprocessor:
    """Chat rendering and tokenization for the routes, on ``num_threads`` threads."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_model_len: int,
        num_threads: int = 2,
        timeout_s: float = 10.0,
        allow_client_template: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.timeout_s = timeout_s
        self.allow_client_template = allow_client_template
        self._pool = concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix="hf-preprocess")
        self._reserved_kwargs = _apply_chat_template_params(tokenizer) - _TEMPLATE_VARIABLE_PARAMS

    def close(self) -> None:
        """Drop queued jobs; running ones finish on their own (threads cannot be interrupted)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def chat(
        self, body: ChatCompletionRequest, reply_prefix: str = "", function: str | None = None
    ) -> list[int]:
        """Prompt ids of a chat request: its messages and tools through the (server's) chat
        template, then ``reply_prefix``; ``function`` (named by ``tool_choice``) must be a tool."""
        template, kwargs = self._template_options(body)
        if not body.messages:
            raise APIError(400, "messages is empty")
        return await self._run(self._render_and_encode, body, template, kwargs, reply_prefix, function)

    async def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        """Prompt ids of each prompt of a text-completion request (token prompts pass through)."""
        prompt = body.prompt
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt is empty")
        # The schema makes the list homogeneous, so its first element tells which kind it is
        # (scanning a million ids in Python would hold the event loop).
        if isinstance(prompt[0], int):
            return [prompt]  # type: ignore[list-item]
        if isinstance(prompt[0], str):
            texts: list[str] = list(prompt)  # type: ignore[arg-type]
            return await self._run(self._encode_all, texts, body.add_special_tokens)
        return list(prompt)  # type: ignore[arg-type]

    # ----------------------------------------------------------------- event-loop side

    def _template_options(self, body: ChatCompletionRequest) -> tuple[str | None, dict[str, Any]]:
        kwargs = dict(body.chat_template_kwargs or {})
        template = kwargs.pop("chat_template", None)
        if body.chat_template is not None:
            template = body.chat_template
        if template is not None and not self.allow_client_template:
            field = (
                "chat_template" if body.chat_template is not None else "chat_template_kwargs.chat_template"
            )
            raise APIError(
                400,
                f"{field}: this server does not accept chat templates from clients (a template is code "
                "the server runs); use the model's own template, or start the server with "
                "inference.allow_client_chat_template = true if every client is trusted",
            )
        if template is not None and not isinstance(template, str):
            raise APIError(400, "chat_template must be a string")
        reserved = sorted(k for k in kwargs if k in self._reserved_kwargs)
        if reserved:
            raise APIError(
                400,
                f"chat_template_kwargs: {reserved} are options of the renderer, not template variables; "
                "only variables the chat template reads (e.g. enable_thinking) may be set there",
            )
        return template, kwargs

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        future = self._pool.submit(fn, *args)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except TimeoutError:
            if future.cancel():  # never started: the pool was busy with other prompts
                raise APIError(
                    429,
                    f"the server is busy preparing other prompts; none of its "
                    f"inference.num_preprocess_threads was free within inference.preprocess_timeout_s = "
                    f"{self.timeout_s:g} s; retry later",
                    "RateLimitError",
                ) from None
            raise APIError(
                413,
                f"rendering and tokenizing the prompt took longer than inference.preprocess_timeout_s = "
                f"{self.timeout_s:g} s; send a shorter prompt",
                "RequestTooLargeError",
            ) from None
        except PromptTooLong as e:
            raise APIError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens and the prompt "
                f"has {e.num_tokens}: no room to generate; shorten the prompt",
            ) from None

    # ----------------------------------------------------------------- worker-thread side

    def _render_and_encode(
        self,
        body: ChatCompletionRequest,
        template: str | None,
        kwargs: Any,
        reply_prefix: str,
        function: str | None,
    ) -> list[int]:
        tools = template_tools(body.tools, function) if body.tools else None
        if tools and not template_reads_tools(template or getattr(self.tokenizer, "chat_template", None)):
            raise APIError(
                400,
                "tools: this model's chat template does not render tools (the model would never see "
                "them); serve a model whose template does, or leave tools out",
            )
        messages = [template_message(_text_message(m, i), i) for i, m in enumerate(body.messages)]
        check_tool_messages(messages)
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                chat_template=template,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                tokenize=False,
                **kwargs,
            )
        except Exception as e:  # template errors (bad roles, missing template) are the client's to fix
            raise APIError(400, f"could not apply the chat template: {type(e).__name__}: {e}") from e
        if not isinstance(text, str):
            raise APIError(400, f"the chat template rendered a {type(text).__name__}, not text")
        # The template already wrote any BOS/special tokens, so none are added on top (as vLLM does).
        return self._encode(text + reply_prefix, add_special_tokens=False, what="the rendered chat")

    def _encode_all(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        what = "prompt" if len(texts) == 1 else "prompt[{}]"
        return [self._encode(t, add_special_tokens, what.format(i)) for i, t in enumerate(texts)]

    def _encode(self, text: str, add_special_tokens: bool, what: str) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(
                400, f"{what} is not valid Unicode: {e.reason} at character {e.start} ({text[e.start]!r})"
            ) from None
        limit = self.max_model_len - 1  # at least one token must be generated
        backend = _plain_backend(self.tokenizer)
        if backend is None:
            ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
            if len(ids) > limit:
                raise PromptTooLong(len(ids))
            return ids
        # What the transformers wrapper calls too (``encode_batch`` releases the GIL); the length
        # is known before the ids become Python ints.
        (encoding,) = backend.encode_batch([text], add_special_tokens=add_special_tokens)
        if len(encoding) > limit:
            raise PromptTooLong(len(encoding))
        return list(encoding.ids)


def _plain_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer behind a fast tokenizer, when calling it directly gives the ids the
    transformers wrapper gives (no truncation or padding set, special tokens handled alike);
    else ``None`` (the wrapper is used)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch"):
        return None
    if backend.truncation is not None or backend.padding is not None:
        return None
    if bool(getattr(tokenizer, "split_special_tokens", False)) != bool(backend.encode_special_tokens):
        return None
    return backend


def _apply_chat_template_params(tokenizer: Any) -> set[str]:
    try:
        parameters = inspect.signature(tokenizer.apply_chat_template).parameters
    except (TypeError, ValueError, AttributeError):
        return set()
    return {n for n, p in parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def _text_message(message: Any, position: int) -> dict[str, Any]:
    """``message`` with a list of text parts joined into one string; refuses other shapes."""
    if not isinstance(message, dict):
        raise APIError(400, f"messages[{position}] must be an object, got {type(message).__name__}")
    role = message.get("role")
    if not isinstance(role, str):
        missing = "role" not in message
        raise APIError(
            400,
            f"messages[{position}] has no role" if missing else f"messages[{position}].role must be a string",
        )
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(
                    400, f"messages[{position}] has a {kind!r} part: the hf backend serves text only"
                )
            text = part.get("text", "")
            if not isinstance(text, str):
                raise APIError(400, f"messages[{position}].content: a text part's text must be a string")
            texts.append(text)
        message = {**message, "content": "\n".join(texts)}
    elif content is None:
        message = {**message, "content": ""}
    elif not isinstance(content, str):
        raise APIError(
            400,
            f"messages[{position}].content must be a string, a list of text parts or null, "
            f"got {type(content).__name__}",
        )
    return message

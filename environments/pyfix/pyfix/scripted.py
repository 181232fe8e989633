"""Scripted pyfix agents behind an OpenAI-compatible token-in server, for tests and benchmarks.

``ScriptedServer`` answers vLLM's ``POST /inference/v1/generate`` (and ``GET /v1/models``,
``GET /health``) on 127.0.0.1 the way the agent harness calls it: it decodes the prompt tokens,
finds the task by its user message and the step by the number of assistant turns so far, and
returns the scripted reply's tokens (plus the end-of-turn token) with a fixed logprob per
position (``logprob``); ``calls`` keeps every ``(prompt ids, reply ids)`` it served. With a
``secret`` every route but ``/health`` wants ``Authorization: Bearer <secret>``, as the inference
server does. The request's ``model`` picks the agent (``POLICIES``):

    oracle      the task's reference episode (reward 1)
    noop        answers without touching anything (reward 0)
    broken      writes tool calls that do not parse, every turn, until the turn budget (reward 0)
    bad_edit    an edit whose old_string is not in the file (a tool error), then gives up
    wrong_fix   the oracle's episode with a wrong fix: its last test run fails

Use::

    with ScriptedServer(tokenizer, tasks).serve() as base_url:   # http://127.0.0.1:<port>/v1
        ...
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from pyfix.taskset import MODULE, PyfixData, oracle_replies, tool_call


def _oracle(data: PyfixData, step: int) -> str:
    replies = oracle_replies(data)
    return replies[min(step, len(replies) - 1)]


def _noop(data: PyfixData, step: int) -> str:
    return "The code looks fine to me."


def _broken(data: PyfixData, step: int) -> str:
    return '<tool_call>{"name": "edit_file", "arguments": {"path": "calc.py", "old_string": }</tool_call>'


def _bad_edit(data: PyfixData, step: int) -> str:
    if step == 0:
        return tool_call("edit_file", path=MODULE, old_string=data.fixed, new_string=data.buggy)
    return "I cannot fix it."


def _wrong_fix(data: PyfixData, step: int) -> str:
    replies = oracle_replies(data)
    replies[2] = tool_call("edit_file", path=MODULE, old_string=data.buggy, new_string="0")
    return replies[min(step, len(replies) - 1)]


POLICIES: dict[str, Callable[[PyfixData, int], str]] = {
    "oracle": _oracle,
    "noop": _noop,
    "broken": _broken,
    "bad_edit": _bad_edit,
    "wrong_fix": _wrong_fix,
}


def logprob(position: int) -> float:
    """The scripted logprob of the reply token at ``position``."""
    return -0.01 * (position + 1)


class ScriptedServer:
    """See the module docstring."""

    def __init__(
        self,
        tokenizer: Any,
        tasks: Iterable[PyfixData],
        *,
        max_model_len: int = 4096,
        assistant_marker: str = "<|im_start|>assistant",
        secret: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.secret = secret
        self.calls: list[tuple[list[int], list[int]]] = []
        self.tasks = {data.prompt: data for data in tasks if isinstance(data.prompt, str)}
        self.max_model_len = max_model_len
        self.assistant_marker = assistant_marker
        self.num_requests = 0
        self.app = FastAPI()
        self.app.post("/inference/v1/generate")(self._generate)
        self.app.get("/v1/models")(self._models)
        self.app.get("/health")(self._health)
        self.app.middleware("http")(self._guard)

    async def _guard(self, request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        guarded = self.secret is not None and request.url.path != "/health"
        if guarded and request.headers.get("authorization") != f"Bearer {self.secret}":
            return JSONResponse({"error": {"message": "missing or wrong bearer token"}}, status_code=401)
        return await call_next(request)

    def reply(self, policy: str, prompt_text: str) -> str:
        """The scripted reply of ``policy`` to the rendered prompt ``prompt_text``."""
        found = [data for prompt, data in self.tasks.items() if prompt in prompt_text]
        if not found:
            raise LookupError("no pyfix task's prompt is in this conversation")
        data = max(found, key=lambda d: len(str(d.prompt)))
        step = prompt_text.count(self.assistant_marker) - 1
        return POLICIES[policy](data, max(step, 0))

    async def _generate(self, body: dict[str, Any]) -> JSONResponse:
        self.num_requests += 1
        policy = body.get("model")
        if policy not in POLICIES:
            return JSONResponse({"error": {"message": f"no scripted agent {policy!r}"}}, status_code=404)
        params = body.get("sampling_params") or {}
        prompt = list(body["token_ids"])
        text = self.tokenizer.decode(prompt, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        try:
            reply = self.reply(policy, text)
        except LookupError as e:
            return JSONResponse({"error": {"message": str(e)}}, status_code=400)
        ids = [*self.tokenizer.encode(reply, add_special_tokens=False), self.tokenizer.eos_token_id]
        finish = "stop"
        max_tokens = params.get("max_tokens")
        if max_tokens is not None and len(ids) > max_tokens:
            ids, finish = ids[:max_tokens], "length"
        self.calls.append((prompt, ids))
        content = [
            {"token": f"token_id:{t}", "logprob": logprob(j), "top_logprobs": []} for j, t in enumerate(ids)
        ]
        return JSONResponse(
            {
                "request_id": f"scripted-{self.num_requests}",
                "choices": [
                    {"index": 0, "token_ids": ids, "logprobs": {"content": content}, "finish_reason": finish}
                ],
                "prompt_token_ids": prompt,
            }
        )

    async def _models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "max_model_len": self.max_model_len} for name in POLICIES
            ],
        }

    async def _health(self) -> dict[str, str]:
        return {"status": "ok"}

    @contextlib.contextmanager
    def serve(self) -> Iterator[str]:
        """Serve on a free port of 127.0.0.1 in a thread; yields the OpenAI base URL."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the scripted server did not start")
            time.sleep(0.01)
        try:
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            server.should_exit = True
            thread.join(timeout=10)

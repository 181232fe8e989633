"""Fake OpenAI-compatible teachers for tests and ``bench/replay.py``: policies and faults.

``fake_teacher_app(policy, fault=...)`` is a FastAPI app with ``POST /v1/chat/completions`` that
answers with ``policy(messages)`` (an action object such as ``{"tool": "bash", "arguments":
{"command": "pytest"}}``, written as JSON in the message content) and a ``usage`` block, or
misbehaves:

    timeout   sleeps ``delay_s`` (longer than the client's timeout) before answering
    slow      sleeps ``delay_s``, then answers normally
    500       answers HTTP 500
    429       answers HTTP 429 with ``Retry-After: 0``
    garbage   answers 200 with a body that is not JSON
    no_json   answers 200 with a message whose content holds no JSON action
    flaky     fails the first ``fail_first`` requests with 503, then answers normally
    trickle   answers 200 and sends its body one byte every ``delay_s`` seconds (a read never
              waits long, the answer never ends in time)
    huge      answers 200 with a JSON body of ``huge_bytes`` bytes, sent in 64 KiB chunks as the
              client reads them (``app.state.sent_bytes`` counts what went out)

With ``bill`` (a file path and ``prices``, dollars per million input and output tokens) the fake
keeps its own bill, as a provider does: one JSON line ``{"n": request number, "usd": cost}`` per
request it charges for, appended (and flushed) when it starts on the request, before any delay:
every request but the ``500``/``429``/``flaky`` refusals, charged at the usage it reports (the
huge and trickled answers at their prompt plus ``max_tokens``), whether or not the client is still
there to read the answer.

Every request is appended to ``app.state.requests`` (time, prompt hash, model, authorization
header), so tests can count what reached the endpoint. Serve it with ``prime_composer.inference.local.running_app``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from prime_composer.teacher.prompts import prompt_hash

Policy = Callable[[list[dict[str, str]]], dict[str, Any]]


def fixed(action: dict[str, Any]) -> Policy:
    """Always the same action."""
    return lambda messages: action


def messages_key(messages: list[dict[str, str]]) -> str:
    """A request's ``prompts.prompt_hash`` (what the response cache stores as ``prompt_hash``)."""
    return prompt_hash(messages)


def fake_teacher_app(
    policy: Policy,
    *,
    fault: str | None = None,
    delay_s: float = 0.0,
    fail_first: int = 0,
    tokens_per_char: float = 0.25,
    huge_bytes: int = 20_000_000,
    bill: Path | None = None,
    prices: tuple[float, float] = (0.0, 0.0),
) -> FastAPI:
    app = FastAPI()
    app.state.requests = []
    app.state.sent_bytes = 0

    def usage(messages: list[dict[str, str]], content: str) -> dict[str, int]:
        prompt_chars = sum(len(m["content"]) for m in messages)
        return {
            "prompt_tokens": int(prompt_chars * tokens_per_char) + 8,
            "completion_tokens": max(1, int(len(content) * tokens_per_char)),
        }

    def charge(number: int, tokens: dict[str, int]) -> None:
        if bill is None:
            return
        usd = (tokens["prompt_tokens"] * prices[0] + tokens["completion_tokens"] * prices[1]) / 1e6
        with open(bill, "a") as f:
            f.write(json.dumps({"n": number, "usd": usd}) + "\n")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.json()
        messages = body["messages"]
        app.state.requests.append(
            {
                "time": time.time(),
                "key": messages_key(messages),
                "model": body.get("model"),
                "authorization": request.headers.get("authorization"),
            }
        )
        number = len(app.state.requests)
        content = (
            "I think we should look at the tests first."
            if fault == "no_json"
            else json.dumps(policy(messages))
        )
        refused = fault in ("500", "429") or (fault == "flaky" and number <= fail_first)
        if fault in ("trickle", "huge"):
            charge(number, {**usage(messages, ""), "completion_tokens": int(body.get("max_tokens") or 0)})
        elif not refused:
            charge(number, usage(messages, content))
        if fault in ("timeout", "slow"):
            await asyncio.sleep(delay_s)
        if fault == "trickle":

            async def trickle() -> AsyncIterator[bytes]:
                for byte in json.dumps({"choices": [{"message": {"content": content}}]}).encode():
                    await asyncio.sleep(delay_s)
                    yield bytes([byte])

            return StreamingResponse(trickle(), media_type="application/json")
        if fault == "huge":
            head = b'{"choices": [{"message": {"role": "assistant", "content": "'
            tail = b'"}}]}'

            async def huge() -> AsyncIterator[bytes]:
                yield head
                left = huge_bytes - len(head) - len(tail)
                while left > 0:
                    chunk = b"x" * min(65536, left)
                    left -= len(chunk)
                    app.state.sent_bytes += len(chunk)
                    yield chunk
                yield tail

            return StreamingResponse(huge(), media_type="application/json")
        if fault == "500":
            return JSONResponse({"error": {"message": "internal error"}}, status_code=500)
        if fault == "429":
            return JSONResponse(
                {"error": {"message": "rate limited"}}, status_code=429, headers={"Retry-After": "0"}
            )
        if fault == "flaky" and number <= fail_first:
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        if fault == "garbage":
            return Response(b"<html>502 Bad Gateway</html>\x00\xff", status_code=200, media_type="text/html")
        return JSONResponse(
            {
                "id": f"fake-{number}",
                "object": "chat.completion",
                "model": body.get("model"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": "stop",
                    }
                ],
                "usage": usage(messages, content),
            }
        )

    return app

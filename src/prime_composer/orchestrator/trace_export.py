"""An agent episode's Samples as one trace of the replay service's store (``teacher/traces.py``).

The per-turn records every agent Sample carries (``info["turns"]``: token span, tool calls, tool
results with exit codes) and its conversation (``info["messages"]``) are enough to rebuild the
episode step by step: each assistant turn with its parsed tool calls, its sampled ``token_ids``
and ``logprobs`` and the exact ``prompt_token_ids`` it was given; each tool result with its exit
code and whether it failed. An episode split in several Samples (a history-rewriting template)
gives one trace: the Samples share the conversation and each contributes its own turns.

    record = episode_trace(samples)       # one JSON line of the trace store
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prime_composer.orchestrator.episode import ToolOutcome, TurnInfo
from prime_composer.orchestrator.sample import Sample
from prime_composer.tool_calls import get_parser


def episode_trace(samples: Sequence[Sample]) -> dict[str, Any]:
    """The trace record of one episode's Samples (all from the same trace, ``info["trace_id"]``)."""
    if not samples or any(s.info.get("trace_id") != samples[0].info.get("trace_id") for s in samples):
        raise ValueError("episode_trace needs the Samples of exactly one episode (one trace_id)")
    info = samples[0].info
    if "turns" not in info or "messages" not in info:
        raise ValueError("these Samples carry no per-turn records (info['turns'] and info['messages'])")
    parser = get_parser(info.get("tool_call_format", "hermes"))
    steps: dict[int, tuple[Sample, TurnInfo]] = {}
    for sample in samples:
        for turn in sample.info["turns"]:
            if turn.message_index is not None:
                steps[turn.message_index] = (sample, turn)
    results: dict[str, ToolOutcome] = {r.call_id: r for s, t in steps.values() for r in t.tool_results}
    turns: list[dict[str, Any]] = []
    for index, message in enumerate(info["messages"]):
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and index in steps:
            sample, turn = steps[index]
            start, end = turn.span
            turns.append(
                {
                    "role": "assistant",
                    "content": parser.parse(content).content,
                    "tool_calls": [
                        {"id": c.id, "name": c.name, "arguments": c.arguments} for c in turn.tool_calls
                    ],
                    "token_ids": sample.completion_ids[start:end],
                    "prompt_token_ids": sample.prompt_ids + sample.completion_ids[:start],
                    "logprobs": sample.completion_logprobs[start:end],
                }
            )
        elif role == "tool":
            result = results.get(message.get("tool_call_id", ""))
            turns.append(
                {
                    "role": "tool",
                    "content": content,
                    "tool_call_id": message.get("tool_call_id"),
                    "name": message.get("name"),
                    "exit_code": result.exit_code if result else None,
                    "is_error": (not result.ok) if result else None,
                }
            )
        else:
            turns.append({"role": role, "content": content})
    task = info.get("task", {})
    return {
        "id": str(info.get("trace_id")),
        "task": task.get("prompt", task) if isinstance(task, dict) else task,
        "tools": [t.get("function", t) for t in info.get("tools") or []],
        "turns": turns,
        "reward": samples[0].reward,
        "info": {"env": info.get("env"), "task_id": info.get("task_id"), "stop": info.get("stop")},
    }

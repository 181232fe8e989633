"""Samples as traces of the replay service's store (``teacher/traces.py``): the one converter from
the orchestrator's episodes to the teacher, read from each Sample's ``EpisodeRecord``.

    records = samples_to_traces(samples)  # one trace per episode, as the service imports them

The per-turn records every rollout Sample carries (``episode.turns``: token span, tool calls, tool
results with exit codes) and its conversation (``episode.messages``) are enough to rebuild the
episode step by step: each assistant turn with its parsed tool calls, its sampled ``token_ids``
and ``logprobs`` and the exact ``prompt_token_ids`` it was given; each tool result with its exit
code and whether it failed. An episode split in several Samples (a history-rewriting template)
gives one trace: the Samples share the conversation and each contributes its own turns.

A Sample without per-turn records (built by hand, say) becomes one trace of its messages, with the
exact tokens the policy saw and sampled (``prompt_token_ids``, ``token_ids``) and their logprobs
on its only assistant turn (``sample_to_trace``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prime_composer.orchestrator.episode import ToolOutcome, TurnInfo
from prime_composer.orchestrator.sample import Sample
from prime_composer.tool_calls import get_parser


def episode_trace(samples: Sequence[Sample]) -> dict[str, Any]:
    """The trace record of one episode's Samples (all from the same trace, ``episode.trace_id``)."""
    if not samples or any(s.episode.trace_id != samples[0].episode.trace_id for s in samples):
        raise ValueError("episode_trace needs the Samples of exactly one episode (one trace_id)")
    info = samples[0].episode
    if info.turns is None:
        raise ValueError("these Samples carry no per-turn records (episode.turns)")
    parser = get_parser(info.tool_call_format or "hermes")
    steps: dict[int, tuple[Sample, TurnInfo]] = {}
    for sample in samples:
        for turn in sample.episode.turns or []:
            if turn.message_index is not None:
                steps[turn.message_index] = (sample, turn)
    results: dict[str, ToolOutcome] = {r.call_id: r for s, t in steps.values() for r in t.tool_results}
    turns: list[dict[str, Any]] = []
    for index, message in enumerate(info.messages):
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
    task = info.task if info.task is not None else {}
    return {
        "id": str(info.trace_id),
        "task": task.get("prompt", task),
        "tools": [t.get("function", t) for t in info.tools or []],
        "turns": turns,
        "reward": samples[0].reward,
        "info": {"env": info.env, "task_id": info.task_id, "stop": info.stop},
    }


def episode_key(sample: Sample) -> str | None:
    """The episode a Sample with per-turn records belongs to (its ``trace_id``); None otherwise."""
    if sample.episode.turns is None or sample.episode.trace_id is None:
        return None
    return str(sample.episode.trace_id)


def sample_to_trace(sample: Sample) -> dict[str, Any] | None:
    """The trace record of a finished sample, or None when it has no messages to replay."""
    messages = sample.episode.messages
    turns = [
        {"role": m["role"], "content": m.get("content") if isinstance(m.get("content"), str) else ""}
        for m in messages
        if isinstance(m, dict) and m.get("role") in ("system", "user", "assistant", "tool")
    ]
    assistant = [i for i, t in enumerate(turns) if t["role"] == "assistant"]
    if not assistant or sample.error is not None:
        return None
    last = turns[assistant[-1]]
    policy = [i for i, m in enumerate(sample.completion_mask) if m]
    if len(assistant) == 1 and policy:
        last["prompt_token_ids"] = list(sample.prompt_ids)
        last["token_ids"] = [sample.completion_ids[i] for i in policy]
        last["logprobs"] = [sample.completion_logprobs[i] for i in policy]
    trace: dict[str, Any] = {"turns": turns, "reward": sample.reward}
    if sample.episode.trace_id:
        trace["id"] = str(sample.episode.trace_id)
    if sample.episode.task is not None:
        trace["task"] = sample.episode.task
    return trace


def samples_to_traces(samples: list[Sample]) -> list[dict[str, Any]]:
    """The trace records of finished samples: one per agent episode, one per plain sample."""
    traces: list[dict[str, Any]] = []
    episodes: dict[str, list[Sample]] = {}
    for sample in samples:
        if (key := episode_key(sample)) is not None:
            if sample.error is None:
                episodes.setdefault(key, []).append(sample)
        elif (trace := sample_to_trace(sample)) is not None:
            traces.append(trace)
    traces.extend(episode_trace(episode) for episode in episodes.values())
    return traces

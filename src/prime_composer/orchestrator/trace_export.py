"""Samples as traces of the replay service's store (``teacher/traces.py``): the one converter from
the orchestrator's episodes to the teacher, read from each Sample's ``EpisodeRecord``.

    records = samples_to_traces(samples)  # one trace per episode, as the service imports them

The per-turn records every rollout Sample carries (``episode.turns``: token span, tool calls, tool
results with exit codes) and its conversation (``episode.messages``) are enough to rebuild the
episode step by step: each assistant turn with its parsed tool calls, its sampled ``token_ids``
and ``logprobs`` and the exact ``prompt_token_ids`` it was given; each tool result with its exit
code and whether it failed. An episode split in several Samples (a history-rewriting template)
gives one trace: the Samples share the conversation and each contributes its own turns.

A Sample without per-turn records (built by hand, say) goes through the same converter as an
episode of its own: its policy tokens (``completion_mask``), when they are one run, are the turn of
its only assistant message (``sample_turns``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prime_composer.orchestrator.episode import ToolOutcome, TurnInfo
from prime_composer.orchestrator.sample import Sample
from prime_composer.tool_calls import get_parser


def sample_turns(sample: Sample) -> list[TurnInfo]:
    """The per-turn records of a Sample: its own (``episode.turns``), or for a Sample built without
    them one turn over its policy tokens at its only assistant message (none when its policy tokens
    are not one run or it has not exactly one assistant message)."""
    if sample.episode.turns is not None:
        return sample.episode.turns
    assistant = [i for i, m in enumerate(sample.episode.messages) if _role(m) == "assistant"]
    policy = [i for i, m in enumerate(sample.completion_mask) if m]
    if len(assistant) != 1 or not policy or policy != list(range(policy[0], policy[-1] + 1)):
        return []
    return [
        TurnInfo(
            index=0,
            span=(policy[0], policy[-1] + 1),
            message_index=assistant[0],
            finish_reason="length" if sample.is_truncated else None,
        )
    ]


def episode_trace(samples: Sequence[Sample]) -> dict[str, Any] | None:
    """The trace record of one episode's Samples (all from the same trace, ``episode.trace_id``), or
    None when it has no assistant turn to replay or every Sample of it failed."""
    if not samples or any(s.episode.trace_id != samples[0].episode.trace_id for s in samples):
        raise ValueError("episode_trace needs the Samples of exactly one episode (one trace_id)")
    if all(s.error is not None for s in samples):
        return None
    info = samples[0].episode
    parser = get_parser(info.tool_call_format or "hermes")
    steps = _steps_by_message(samples)
    results: dict[str, ToolOutcome] = {r.call_id: r for s, t in steps.values() for r in t.tool_results}
    turns: list[dict[str, Any]] = []
    for index, message in enumerate(info.messages):
        role = _role(message)
        if role is None:
            continue
        content = message["content"] if isinstance(message.get("content"), str) else ""
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
                    # Only a cut is marked (a side without its end token); a turn that stopped is as before.
                    **({"finish_reason": "length"} if turn.finish_reason == "length" else {}),
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
    if not any(t["role"] == "assistant" for t in turns):
        return None
    task = info.task if info.task is not None else {}
    trace: dict[str, Any] = {"id": str(info.trace_id)} if info.trace_id else {}
    trace.update(
        {
            "task": task.get("prompt", task),
            "tools": [t.get("function", t) for t in info.tools or []],
            "turns": turns,
            "reward": samples[0].reward,
            "info": {"env": info.env, "task_id": info.task_id, "stop": info.stop},
        }
    )
    return trace


def episode_steps(samples: Sequence[Sample]) -> list[tuple[Sample, TurnInfo] | None]:
    """The Sample and turn record behind each assistant turn of ``episode_trace(samples)``, in the
    trace's order (None for an assistant message no Sample has a turn record of): how a value the
    service gives per step of the trace goes back to the tokens of that step."""
    steps = _steps_by_message(samples)
    messages = samples[0].episode.messages if samples else []
    return [steps.get(i) for i, m in enumerate(messages) if _role(m) == "assistant"]


def _steps_by_message(samples: Sequence[Sample]) -> dict[int, tuple[Sample, TurnInfo]]:
    steps: dict[int, tuple[Sample, TurnInfo]] = {}
    for sample in samples:
        for turn in sample_turns(sample):
            if turn.message_index is not None:
                steps[turn.message_index] = (sample, turn)
    return steps


def _role(message: Any) -> str | None:
    """A message's role when it is one a trace holds (``teacher.traces.Turn``), else None."""
    role = message.get("role") if isinstance(message, dict) else None
    return role if role in ("system", "user", "assistant", "tool") else None


def episode_key(sample: Sample) -> str | None:
    """The episode a Sample with per-turn records belongs to (its ``trace_id``); None otherwise."""
    if sample.episode.turns is None or sample.episode.trace_id is None:
        return None
    return str(sample.episode.trace_id)


def episodes(samples: Sequence[Sample]) -> list[list[Sample]]:
    """The samples grouped by episode, in order of first appearance: the Samples of a split episode
    (``episode_key``) together, every other Sample alone."""
    groups: dict[str | int, list[Sample]] = {}
    for number, sample in enumerate(samples):
        key = episode_key(sample)
        groups.setdefault(number if key is None else key, []).append(sample)
    return list(groups.values())


def samples_to_traces(samples: Sequence[Sample]) -> list[dict[str, Any]]:
    """The trace records of finished samples, one per episode (failed Samples left out)."""
    finished = [s for s in samples if s.error is None]
    return [trace for group in episodes(finished) if (trace := episode_trace(group)) is not None]

"""What teachers and the student are shown at a step.

Teachers get a portable transcript: the service's instructions as the system message, then the
state as one user message: ``### User`` / ``### Agent`` / ``### Tool result (name, exit code N)``
sections (the agent's tool calls written as ``<tool_call>`` JSON), ending with the question.
The teacher reviews the agent's work rather than playing the agent (its own assistant turns would
claim the trace's actions as its own), every OpenAI-compatible API accepts it (no native tool
messages or role alternation, whose rules differ by provider), and it is a pure function of the
state, so the same state gives the same request (the response cache depends on that).

The student sees the state in its own chat format (``student_messages``): tool calls rendered as
``actions.render_action`` writes them, tool results as ``tool`` messages; its tokenizer's chat
template turns them into the pair's context token ids unless the trace carries the exact ids.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from prime_composer.teacher.actions import render_action, turn_action
from prime_composer.teacher.traces import Trace, Turn

NEXT_ACTION = "What is the single best next action? Reply with one JSON object."


def _tool_result_header(turn: Turn) -> str:
    details = [d for d in (turn.name, None if turn.exit_code is None else f"exit code {turn.exit_code}") if d]
    if turn.is_error:
        details.append("error")
    return "Tool result" + (f" ({', '.join(details)})" if details else "")


def _assistant_text(turn: Turn) -> str:
    rendered = render_action(turn_action(turn)) if turn.tool_calls else ""
    return "\n".join(p for p in (turn.content.strip(), rendered) if p)


def _task_text(task: str | dict[str, Any]) -> str:
    return task if isinstance(task, str) else json.dumps(task, sort_keys=True, ensure_ascii=False)


def teacher_messages(trace: Trace, turn_index: int, instructions: str) -> list[dict[str, str]]:
    """The chat messages a teacher gets to propose the action of ``turns[turn_index]``: the
    instructions as the system message, and the state as one user message holding the transcript."""
    system = instructions
    if trace.record.tools:
        system += "\n\nTools available to the agent:\n" + json.dumps(
            trace.record.tools, sort_keys=True, ensure_ascii=False
        )
    turns = trace.turns[:turn_index]
    sections = []
    if not any(t.role == "user" for t in turns) and trace.record.task:
        sections.append("### Task\n" + _task_text(trace.record.task))
    for turn in turns:
        if turn.role == "system":
            sections.append("### Agent instructions\n" + turn.content)
        elif turn.role == "user":
            sections.append("### User\n" + turn.content)
        elif turn.role == "assistant":
            sections.append("### Agent\n" + (_assistant_text(turn) or "(no output)"))
        else:
            sections.append("### " + _tool_result_header(turn) + "\n" + turn.content)
    sections.append("### Next\n" + NEXT_ACTION)
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(sections)}]


def prompt_hash(messages: list[dict[str, str]]) -> str:
    """Hash of the exact request messages (state and instructions)."""
    blob = json.dumps(messages, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def student_messages(trace: Trace, turn_index: int) -> list[dict[str, str]]:
    """The state before ``turns[turn_index]`` in the student's chat format."""
    messages: list[dict[str, str]] = []
    turns = trace.turns[:turn_index]
    for turn in turns:
        if turn.role == "assistant":
            messages.append({"role": "assistant", "content": _assistant_text(turn)})
        else:
            messages.append({"role": turn.role, "content": turn.content})
    if not any(t.role == "user" for t in turns) and trace.record.task:
        after_system = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
        messages.insert(after_system, {"role": "user", "content": _task_text(trace.record.task)})
    return messages

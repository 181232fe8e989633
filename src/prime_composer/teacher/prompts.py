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

A teacher that plays the agent (``protocol = "agent"``) and the student's own on-policy samples are
*sent* the state, to an OpenAI-compatible server, as ``agent_messages``: the same chat with each
assistant turn's calls as ``tool_calls`` and each tool result answering its call by
``tool_call_id``, the shape every such server requires (a ``tool`` message that answers no call is
refused with a 400) and renders in its model's own tool-call format.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, TypeVar

from prime_composer.teacher.actions import render_action, turn_action
from prime_composer.teacher.traces import Trace, Turn

_Message = TypeVar("_Message", dict[str, str], dict[str, Any])

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


def prompt_hash(messages: list[dict[str, Any]] | list[int]) -> str:
    """Hash of the exact request messages (state and instructions), or of a prompt's token ids."""
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
    return _with_task(trace, turns, messages)


def agent_messages(trace: Trace, turn_index: int) -> list[dict[str, Any]]:
    """The state before ``turns[turn_index]`` as an OpenAI chat request for the agent itself: each
    assistant turn's text with its calls as ``tool_calls`` (the trace's ids, else
    ``call_<turn>_<k>``), each tool result a ``tool`` message naming the call it answers (the
    trace's ``tool_call_id`` when it names an open call, else the next unanswered one). A result
    that answers no call (its assistant turn made none), and calls no result answers, are kept as
    text (a user message ``Tool result ...``; the call in its assistant turn's text), since a
    server refuses both."""
    messages: list[dict[str, Any]] = []
    pending: dict[str, str] = {}  # the latest assistant message's unanswered call ids -> as text
    calls_at: int | None = None  # that message's index

    def close() -> None:
        if calls_at is None or not pending:
            return
        message = messages[calls_at]
        message["content"] = "\n".join(p for p in (message["content"], *pending.values()) if p)
        message["tool_calls"] = [c for c in message["tool_calls"] if c["id"] not in pending]
        if not message["tool_calls"]:
            del message["tool_calls"]
        pending.clear()

    for index, turn in enumerate(trace.turns[:turn_index]):
        if turn.role == "tool":
            if pending:
                call_id = turn.tool_call_id if turn.tool_call_id in pending else next(iter(pending))
                del pending[call_id]
                messages.append({"role": "tool", "tool_call_id": call_id, "content": turn.content})
            else:
                messages.append({"role": "user", "content": f"{_tool_result_header(turn)}:\n{turn.content}"})
            continue
        close()
        calls_at = None
        if turn.role == "assistant" and turn.tool_calls:
            calls = []
            for k, call in enumerate(turn.tool_calls):
                call_id = call.id if call.id and call.id not in pending else f"call_{index}_{k}"
                arguments = call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments)
                calls.append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": arguments},
                    }
                )
                raw = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
                pending[call_id] = f"<tool_call>\n{raw}\n</tool_call>"
            messages.append({"role": "assistant", "content": turn.content.strip(), "tool_calls": calls})
            calls_at = len(messages) - 1
        else:
            messages.append({"role": turn.role, "content": turn.content})
    close()
    return _with_task(trace, trace.turns[:turn_index], messages)


def _with_task(trace: Trace, turns: list[Turn], messages: list[_Message]) -> list[_Message]:
    """``messages`` with the trace's task as a user message after the system one, when ``turns``
    (the state) hold no user turn."""
    if not any(t.role == "user" for t in turns) and trace.record.task:
        after_system = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
        messages.insert(after_system, {"role": "user", "content": _task_text(trace.record.task)})
    return messages

"""Token-level pieces of an SDPO teacher context: turns, the hinted re-render, middle truncation.

The student is the rollout as sampled: ``prompt_ids + completion_ids``. The teacher must score the
*same* target-turn tokens after the same context with a hint inserted. We get the teacher context
by rendering the trace's messages up to the target turn, with the hint message inserted, through
the tokenizer's own chat template (the one the inference server rendered the rollout with), and we
only trust that render after checking that the same messages *without* the hint reproduce the
student's context token for token. A mismatch (other template, tools or template kwargs we were not
told about, a thinking mode that rewrites earlier turns) would make teacher and student disagree
from the first token, so such a sample gets no hint (counted as ``render_mismatch``).

Truncation cuts the middle: the task statement (everything up to the end of the first user message)
and the end (hint + generation prompt) are kept, the history between is cut from its oldest side.
Positions are renumbered from 0 by packing, so a cut sequence stays contiguous.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prime_composer.config.sdpo import HintConfig


def assistant_turns(completion_mask: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, end)`` of every run of policy tokens (mask 1) in a completion: one per assistant turn."""
    turns: list[tuple[int, int]] = []
    start = None
    for i, m in enumerate(completion_mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            turns.append((start, i))
            start = None
    if start is not None:
        turns.append((start, len(completion_mask)))
    return turns


def text_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with text-only content, as the inference server renders them: a list of text parts
    is joined with newlines, a missing content becomes ``""``."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        out.append({**message, "content": content if content is not None else ""})
    return out


def turn_context(messages: Sequence[dict[str, Any]], turn: int) -> list[dict[str, Any]] | None:
    """The messages before the ``turn``-th assistant message (0-based), or None if there is no such
    turn. A trace that did not record its last reply (messages end before it) is accepted for the
    turn right after its last assistant message."""
    seen = 0
    for i, message in enumerate(messages):
        if message.get("role") == "assistant":
            if seen == turn:
                return list(messages[:i])
            seen += 1
    return list(messages) if seen == turn and messages else None


def with_hint(context: Sequence[dict[str, Any]], hint: str, cfg: HintConfig) -> list[dict[str, Any]]:
    """``context`` with ``hint`` inserted right before the next assistant turn (see ``cfg.placement``)."""
    messages = [dict(m) for m in context]
    if cfg.placement == "message":
        return [*messages, {"role": cfg.hint_role, "content": hint}]
    for message in reversed(messages):
        if message.get("role") != "assistant":
            message["content"] = f"{message['content']}\n\n{hint}"
            return messages
    raise ValueError(
        'orchestrator.sdpo.placement = "append" needs a non-assistant message before the target turn'
    )


def render_ids(
    tokenizer: Any, messages: Sequence[dict[str, Any]], template_kwargs: dict[str, Any] | None
) -> list[int]:
    """Token ids of ``messages`` + the generation prompt, rendered as the inference server does (chat
    template to text, then encoded without extra special tokens: the template writes them)."""
    text = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
    )
    return tokenizer.encode(text, add_special_tokens=False)


def task_statement_ids(
    tokenizer: Any, messages: Sequence[dict[str, Any]], template_kwargs: dict[str, Any] | None
) -> list[int]:
    """Rendered tokens of the messages up to and including the first user message (the task)."""
    for i, message in enumerate(messages):
        if message.get("role") == "user":
            text = tokenizer.apply_chat_template(
                list(messages[: i + 1]),
                add_generation_prompt=False,
                tokenize=False,
                **(template_kwargs or {}),
            )
            return tokenizer.encode(text, add_special_tokens=False)
    return []


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def fit_teacher(
    teacher_prefix: list[int],
    student_context: Sequence[int],
    task_ids: Sequence[int],
    span_len: int,
    seq_len: int,
) -> tuple[list[int], int] | None:
    """Cut ``teacher_prefix`` so that it plus ``span_len`` target tokens fit in ``seq_len``.

    The prefix is split into head (the task statement), middle (history shared with the student
    context, before the hint) and tail (from the hint on). The middle loses its oldest tokens first;
    if head + tail + span still do not fit, the span is shortened from its end.

    Returns ``(prefix, span_len)`` (both possibly shortened), or None if head + tail leave no room
    for a single target token.
    """
    if len(teacher_prefix) + span_len <= seq_len:
        return teacher_prefix, span_len
    shared = common_prefix_len(teacher_prefix, student_context)
    head = min(common_prefix_len(task_ids, teacher_prefix), shared)
    tail = teacher_prefix[shared:]
    room = seq_len - head - len(tail)
    if room < 1:
        return None
    span_len = min(span_len, room)
    keep_middle = room - span_len
    middle = teacher_prefix[head:shared]
    kept = middle[len(middle) - keep_middle :] if keep_middle > 0 else []
    return teacher_prefix[:head] + kept + tail, span_len

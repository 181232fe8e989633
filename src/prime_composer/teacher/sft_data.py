"""SFT data for a teacher: chats rendered as the service's teacher prompts, answered in its protocol.

    python -m prime_composer.teacher.sft_data --config <teacher.json> --data chats.jsonl --out teacher.jsonl

A locally served teacher (``[teacher.pool.local]``) is a model the ``rl`` launcher fine-tunes before
the run, with the same ``sft`` as the student's warm-up, so that it answers the prompts the service
will really send. Each chat of ``--data`` (the warm-up's ``{"messages": [...]}`` lines: reference
answers of the environments' train split) is read as a trace, and every assistant turn becomes one
example: the teacher messages of that step (``prompts.teacher_messages``, with the config's
``instructions``) followed by the turn's action as the JSON object the instructions ask for
(``{"message": ...}`` or ``{"tool": ..., "arguments": ...}``). The teacher learns the reference
answer at the state, so at a student's wrong step it votes for the right one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from prime_composer.config.cli import load_file
from prime_composer.config.teacher import TeacherServiceConfig
from prime_composer.io import atomic_write_text
from prime_composer.logs import setup_logging
from prime_composer.teacher.actions import Action, turn_action
from prime_composer.teacher.prompts import teacher_messages
from prime_composer.teacher.traces import TraceError, parse_trace


def answer_json(action: Action) -> str:
    """An action as the JSON object ``DEFAULT_INSTRUCTIONS`` asks a teacher to reply with."""
    if action.is_message:
        return json.dumps({"message": action.message or ""}, ensure_ascii=False)
    if len(action.calls) == 1:
        call = action.calls[0]
        return json.dumps({"tool": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return json.dumps(
        {"tool_calls": [{"name": c.name, "arguments": c.arguments} for c in action.calls]},
        ensure_ascii=False,
    )


def chat_to_examples(chat: dict[str, Any], instructions: str, source: str) -> list[dict[str, Any]]:
    """The teacher SFT examples of one chat (one per assistant turn); ``TraceError`` if the chat is
    not a valid trace."""
    turns = []
    for message in chat.get("messages", []):
        turn = {"role": message["role"], "content": message.get("content") or ""}
        calls = message.get("tool_calls") or []
        if calls:
            turn["tool_calls"] = [
                {"name": (c.get("function") or c)["name"], "arguments": (c.get("function") or c)["arguments"]}
                for c in calls
            ]
        turns.append(turn)
    trace = parse_trace({"turns": turns, "tools": chat.get("tools") or []}, source, _LIMITS)
    return [
        {
            "messages": [
                *teacher_messages(trace, k, instructions),
                {"role": "assistant", "content": answer_json(turn_action(trace.turns[k]))},
            ]
        }
        for k in trace.step_indices
    ]


def export_teacher_data(config: TeacherServiceConfig, data: Path, out: Path) -> int:
    """Write the teacher examples of every chat in ``data`` to ``out``; returns how many."""
    lines = []
    for number, line in enumerate(data.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            examples = chat_to_examples(json.loads(line), config.instructions, f"{data}:{number}")
        except (TraceError, KeyError, json.JSONDecodeError) as e:
            raise ValueError(f"{data}:{number}: not a chat the teacher can learn from ({e})") from None
        lines += [json.dumps(example, ensure_ascii=False) for example in examples]
    if not lines:
        raise ValueError(f"{data}: no assistant turn to learn from")
    atomic_write_text(out, "\n".join(lines) + "\n")
    return len(lines)


_LIMITS = TeacherServiceConfig.model_fields["traces"].default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="the teacher service's resolved config")
    parser.add_argument(
        "--data", type=Path, required=True, help="chats (JSONL) to turn into teacher examples"
    )
    parser.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    args = parser.parse_args()
    logger = setup_logging("teacher-data")
    config = TeacherServiceConfig.model_validate(load_file(args.config, origin="--config").values)
    num = export_teacher_data(config, args.data, args.out)
    logger.info("wrote %d teacher examples from %s to %s", num, args.data, args.out)


if __name__ == "__main__":
    main()

"""A task's prompt as the chat messages the harness sends (used by the environments' loaders and
by the SFT warm-up's reference play, ``sft_play.py``)."""

from __future__ import annotations

from typing import Any

import verifiers.v1 as vf


def task_messages(data: vf.TaskData) -> list[dict[str, Any]]:
    """A task's prompt as chat-template messages (system prompt first), as the harness sends it."""
    from verifiers.v1.dialects.chat import message_to_wire

    messages: list[dict[str, Any]] = []
    if data.system_prompt:
        messages.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        messages.extend(message_to_wire(m) for m in data.prompt or [])
    return messages

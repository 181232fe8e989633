"""Rendering a conversation to the tokens the model sees, turn after turn, without re-tokenizing
what the model sampled.

The multi-turn harness samples token-in/token-out, so the training tokens are exactly the ones
the model saw and produced. Its context after a turn is ``prompt + sampled tokens``; the next
prompt is that context plus the tokens of what came after (tool results, a user turn, the next
generation prompt). ``ChatRenderer.next_prompt`` builds it with PRIME-RL's rule:

- render the whole conversation with the chat template (tools and template kwargs included) and
  the generation prompt, as text;
- if that text starts with the decoded context, the conversation *extends* the context: the
  prompt is the context's tokens followed by the encoding of the rest of the text. The sampled
  tokens are kept as sampled, even where the tokenizer would have merged them differently;
- otherwise the template rewrote history (dropped earlier reasoning, reformatted a reply, ...):
  the prompt is the full rendering, encoded, and it starts a new training sample.

The check is on text, not tokens: a model that samples a word as two pieces still extends its
context, and only a template that really changes earlier text splits an episode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ChatRenderer:
    """A tokenizer's chat template as the harness uses it (see the module docstring)."""

    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the agent harness needs a tokenizer with a chat template")
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.special_ids = frozenset(tokenizer.all_special_ids)

    def text(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        generation_prompt: bool = True,
    ) -> str:
        """The chat template's rendering of ``messages`` (with ``tools`` when given)."""
        kwargs = dict(self.template_kwargs)
        if tools:
            kwargs["tools"] = tools
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )
        assert isinstance(text, str)
        return text

    def encode(self, text: str) -> list[int]:
        # The template writes any special tokens itself.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """The exact text of ``ids``, special tokens included."""
        return str(
            self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        )

    def reply_text(self, completion_ids: Sequence[int], finish_reason: str | None) -> str:
        """The assistant message content of a sampled reply: its text without the end-of-turn token
        the model stopped on (the template writes that one itself)."""
        ids = list(completion_ids)
        if finish_reason == "stop" and ids and ids[-1] in self.special_ids:
            ids = ids[:-1]
        return self.decode(ids)

    def next_prompt(
        self,
        context_ids: Sequence[int] | None,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[list[int], bool]:
        """``(prompt ids, starts a new sample)`` for the next model call on ``messages``.

        ``context_ids`` are the current sample's tokens so far (the previous prompt and the reply
        sampled after it), ``None`` at the start of an episode.
        """
        full = self.text(messages, tools)
        if context_ids is not None:
            seen = self.decode(context_ids)
            if full.startswith(seen):
                return [*context_ids, *self.encode(full[len(seen) :])], False
        return self.encode(full), True


def splice_prompt(
    renderer: ChatRenderer, student_ids: Sequence[int], student_text: str, teacher_text: str
) -> list[int]:
    """Tokens of ``teacher_text`` that keep ``student_ids`` (whose text is ``student_text``) for
    the longest shared part: the student's own tokens up to the last token boundary before the two
    texts differ, then the encoding of the rest of ``teacher_text``.

    This is how an SDPO teacher context (the same history with a hint inserted) is built from a
    rollout: the teacher sees the history token for token as the student did.
    """
    shared = _common_prefix(student_text, teacher_text)
    # The longest prefix of the student's tokens whose text ends within the shared part. Decoded
    # lengths grow with the prefix, so binary search.
    low, high = 0, len(student_ids)
    while low < high:
        middle = (low + high + 1) // 2
        text = renderer.decode(student_ids[:middle])
        if len(text) <= shared and student_text.startswith(text):
            low = middle
        else:
            high = middle - 1
    kept = renderer.decode(student_ids[:low])
    return [*student_ids[:low], *renderer.encode(teacher_text[len(kept) :])]


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n

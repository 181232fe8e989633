"""Incremental detokenization of one completion, with stop strings.

Decoding token by token is wrong for byte-level BPE (a character may span tokens) and for
SentencePiece (a token's leading space depends on its left neighbour). The usual remedy, used
here: decode a short window of already-seen tokens plus the new ones and emit only the text that
extends the window's previous decoding; wait while the tail is an incomplete character (U+FFFD).

Stop strings end the completion at their first occurrence; the text is cut before the stop
string unless ``include_stop``. While streaming, the last ``len(longest stop) - 1`` characters
are held back, since they might be the start of a stop string.
"""

from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 5  # prompt tokens kept as left context, so the first token decodes as in context


class IncrementalDetokenizer:
    """Text of a completion as tokens arrive; ``stop_hit`` is set when a stop string appeared."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int],
        skip_special_tokens: bool,
        stop: tuple[str, ...] = (),
        include_stop: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""
        self.stop_hit: str | None = None
        self._stop_at = 0
        self._num_sent = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def add(self, token_id: int) -> None:
        """Append one token; updates ``text`` and, on a stop string, ``stop_hit``."""
        if self.stop_hit is not None:
            return
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return  # nothing printable yet (special token skipped, or half a character)
        delta = new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        search_from = max(0, len(self.text) - self._holdback)
        self.text += delta
        for stop in self._stop:
            at = self.text.find(stop, search_from)
            if at != -1 and (self.stop_hit is None or at < self._stop_at):
                self.stop_hit, self._stop_at = stop, at
        if self.stop_hit is not None:
            end = self._stop_at + (len(self.stop_hit) if self._include_stop else 0)
            self.text = self.text[:end]

    def flush(self) -> None:
        """At the end: keep an incomplete trailing character as U+FFFD, as a one-shot decode does."""
        if self.stop_hit is not None or self._read_offset == len(self._ids):
            return
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self.text += new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)

    def take_delta(self, final: bool) -> str:
        """Text not yet handed out; holds back a possible stop-string prefix unless ``final``."""
        end = len(self.text) if (final or self.stop_hit is not None) else len(self.text) - self._holdback
        if end <= self._num_sent:
            return ""
        delta = self.text[self._num_sent : end]
        self._num_sent = end
        return delta

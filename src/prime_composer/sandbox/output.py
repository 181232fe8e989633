"""Bounded output: keep the first and last halves of a byte budget and mark what was cut.

The end of a command's output is usually what matters (a traceback, pytest's summary), the start
says what ran, so both halves are kept. The marker states how many bytes were left out so the
model knows the output is incomplete and can narrow its command.
"""

from __future__ import annotations


def marker(num_cut: int, limit: int) -> str:
    """The line that replaces ``num_cut`` bytes left out of an output limited to ``limit`` bytes."""
    return f"\n[... {num_cut} bytes cut: output is limited to {limit} bytes ...]\n"


def truncate_middle(text: str, limit: int) -> tuple[str, bool]:
    """``text`` cut to about ``limit`` UTF-8 bytes (first and last halves kept); and whether it was cut."""
    data = text.encode()
    if len(data) <= limit:
        return text, False
    half = limit // 2
    head, tail = data[:half], data[len(data) - (limit - half) :]
    cut = len(data) - len(head) - len(tail)
    return head.decode(errors="replace") + marker(cut, limit) + tail.decode(errors="replace"), True


class Capture:
    """Keeps the first and last ``limit / 2`` bytes of a stream fed in chunks, and counts all of it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.num_bytes = 0
        self._head = bytearray()
        self._tail = bytearray()

    def feed(self, chunk: bytes) -> None:
        self.num_bytes += len(chunk)
        room = self.limit // 2 - len(self._head)
        if room > 0:
            self._head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self._tail += chunk
            keep = self.limit - self.limit // 2
            if len(self._tail) > keep:
                del self._tail[: len(self._tail) - keep]

    @property
    def truncated(self) -> bool:
        return self.num_bytes > self.limit

    def text(self) -> str:
        if not self.truncated:
            return bytes(self._head + self._tail).decode(errors="replace")
        num_cut = self.num_bytes - len(self._head) - len(self._tail)
        return (
            self._head.decode(errors="replace")
            + marker(num_cut, self.limit)
            + self._tail.decode(errors="replace")
        )

"""Greedy line wrapping."""


class LineBuilder:
    """Collects words into lines no longer than ``width`` characters (a longer word gets a line
    of its own)."""

    def __init__(self, width):
        if width < 1:
            raise ValueError("width must be positive")
        self.width = width
        self.lines = []
        self._current = []
        self._length = 0

    def add_word(self, word):
        """Append ``word`` to the current line, or start a new line when it does not fit."""
        needed = len(word) if not self._current else self._length + 1 + len(word)
        if self._current and needed > self.width:
            self.flush()
            needed = len(word)
        self._current.append(word)
        self._length = needed

    def flush(self):
        """End the current line (if it holds any word)."""
        if self._current:
            self.lines.append(" ".join(self._current))
        self._current = []
        self._length = 0


def wrap(text, width=20):
    """Wrap the words of ``text`` into lines of at most ``width`` characters; returns the lines."""
    builder = LineBuilder(width)
    for word in text.split():
        builder.add_word(word)
    builder.flush()
    return builder.lines

"""Run-length encoding of strings."""


def rle_encode(text):
    """Return the runs of ``text`` as ``(character, run_length)`` tuples, in order.

    >>> rle_encode("aaab")
    [('a', 3), ('b', 1)]
    """
    runs = []
    for char in text:
        if runs and runs[-1][0] == char:
            runs[-1] = (char, runs[-1][1] + 1)
        else:
            runs.append((char, 1))
    return runs


def rle_decode(runs):
    """Rebuild the string whose runs are ``runs`` (the inverse of ``rle_encode``). A run length
    below 1 is a ``ValueError``."""
    parts = []
    for char, length in runs:
        if length < 1:
            raise ValueError(f"bad run length {length} for {char!r}")
        parts.append(char * length)
    return "".join(parts)

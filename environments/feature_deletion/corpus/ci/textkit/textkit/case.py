"""Changing the case and shape of identifiers and titles."""

import re

SMALL_WORDS = frozenset(
    {"a", "an", "and", "as", "at", "but", "by", "for", "in", "of", "on", "or", "the", "to"}
)


def _split_words(text):
    """Split ``text`` into lowercase words at spaces, punctuation and camel-case humps."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", text)
    return [w.lower() for w in re.split(r"[^A-Za-z0-9]+", spaced) if w]


def snake_case(text):
    """Return ``text`` as a snake_case identifier.

    >>> snake_case("HTTP requestHandler v2")
    'http_request_handler_v2'
    """
    words = _split_words(text)
    if not words:
        return ""
    return "_".join(words)


def camel_case(text, upper_first=False):
    """Return ``text`` as a camelCase identifier (CamelCase with ``upper_first``)."""
    words = _split_words(text)
    if not words:
        return ""
    head = words[0].capitalize() if upper_first else words[0]
    return head + "".join(w.capitalize() for w in words[1:])


def title_words(text, small_words=SMALL_WORDS):
    """Title-case ``text``: every word capitalized except ``small_words``, which stay lowercase
    unless they are the first or the last word. Runs of whitespace become one space."""
    words = text.split()
    titled = []
    for i, word in enumerate(words):
        lower = word.lower()
        if 0 < i < len(words) - 1 and lower in small_words:
            titled.append(lower)
        else:
            titled.append(lower[:1].upper() + lower[1:])
    return " ".join(titled)


def slugify(text, sep="-", max_length=None):
    """Return a URL slug: lowercase ASCII words joined by ``sep``, cut at a word boundary so it is at
    most ``max_length`` characters long (when given). Non-ASCII letters are dropped."""
    ascii_text = text.encode("ascii", "ignore").decode()
    words = _split_words(ascii_text)
    slug = ""
    for word in words:
        candidate = word if not slug else slug + sep + word
        if max_length is not None and len(candidate) > max_length:
            break
        slug = candidate
    return slug

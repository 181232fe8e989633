"""Counting things in text."""

from collections import Counter

VOWELS = "aeiou"


def _build_tokenizer_table():
    """Characters that separate words (computed once at import)."""
    table = {}
    for code in range(128):
        char = chr(code)
        if not (char.isalnum() or char == "'"):
            table[code] = " "
    return table


_SEPARATORS = _build_tokenizer_table()


def words_of(text):
    """The lowercase words of ``text`` (letters, digits and apostrophes)."""
    return text.lower().translate(_SEPARATORS).split()


def word_counts(text):
    """Return a dict mapping each lowercase word of ``text`` to how often it occurs."""
    counts = {}
    for word in words_of(text):
        counts[word] = counts.get(word, 0) + 1
    return counts


def top_words(text, n=3):
    """Return the ``n`` most frequent words as ``(word, count)`` pairs, most frequent first; ties
    are broken alphabetically."""
    counts = Counter(words_of(text))
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return ranked[:n]


def vowel_ratio(word):
    """Return the share of the letters of ``word`` that are vowels (0.0 for a word without letters)."""
    letters = [c for c in word.lower() if c.isalpha()]
    if not letters:
        return 0.0
    vowels = sum(1 for c in letters if c in VOWELS)
    return vowels / len(letters)


def iter_ngrams(words, n=2):
    """Yield every run of ``n`` consecutive items of ``words`` as a tuple, in order."""
    if n < 1:
        raise ValueError("n must be at least 1")
    items = list(words)
    for start in range(len(items) - n + 1):
        yield tuple(items[start : start + n])


def longest_common_prefix(words):
    """Return the longest string every item of ``words`` starts with ("" for no words)."""
    words = list(words)
    if not words:
        return ""
    prefix = min(words)
    last = max(words)
    length = 0
    while length < len(prefix) and prefix[length] == last[length]:
        length += 1
    return prefix[:length]


def count_matching(words, predicate):
    """Return how many items of ``words`` satisfy ``predicate``."""
    total = 0
    for word in words:
        if predicate(word):
            total += 1
    return total

"""textkit: small text utilities (a CI project of the feature-deletion environment)."""

from textkit.case import camel_case, slugify, snake_case, title_words
from textkit.rle import rle_decode, rle_encode
from textkit.stats import iter_ngrams, longest_common_prefix, top_words, vowel_ratio, word_counts

__all__ = [
    "camel_case",
    "iter_ngrams",
    "longest_common_prefix",
    "rle_decode",
    "rle_encode",
    "slugify",
    "snake_case",
    "title_words",
    "top_words",
    "vowel_ratio",
    "word_counts",
]

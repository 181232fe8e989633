import pytest
from textkit import iter_ngrams, longest_common_prefix, top_words, vowel_ratio, word_counts
from textkit.stats import count_matching


def test_word_counts(sentence):
    counts = word_counts(sentence)
    assert counts["the"] == 3
    assert counts["dog"] == 2
    assert len(counts) == 9


def test_top_words(sentence):
    assert top_words(sentence, 2) == [("the", 3), ("dog", 2)]
    assert top_words("b a", 5) == [("a", 1), ("b", 1)]


def test_vowel_ratio():
    assert vowel_ratio("banana") == 0.5
    assert vowel_ratio("R2-D2") == 0.0
    assert vowel_ratio("") == 0.0


def test_iter_ngrams():
    assert list(iter_ngrams(["a", "b", "c"], 2)) == [("a", "b"), ("b", "c")]
    assert list(iter_ngrams("xyz", 3)) == [("x", "y", "z")]
    with pytest.raises(ValueError):
        list(iter_ngrams(["a"], 0))


def test_longest_common_prefix():
    assert longest_common_prefix(["interview", "internet", "interval"]) == "inter"
    assert longest_common_prefix(["a", "b"]) == ""
    assert longest_common_prefix([]) == ""


def test_count_matching():
    assert count_matching(["ab", "abc", "b"], lambda w: w.startswith("a")) == 2

import pytest
from textkit.wrap import LineBuilder, wrap


def test_wrap():
    assert wrap("the quick brown fox jumps", 10) == ["the quick", "brown fox", "jumps"]
    assert wrap("a verylongword b", 4) == ["a", "verylongword", "b"]
    assert wrap("", 5) == []


def test_line_builder():
    builder = LineBuilder(5)
    for word in ["ab", "cd", "ef"]:
        builder.add_word(word)
    builder.flush()
    assert builder.lines == ["ab cd", "ef"]
    with pytest.raises(ValueError):
        LineBuilder(0)

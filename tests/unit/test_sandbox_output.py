"""Bounded output keeps the first and last halves and says exactly how many bytes it cut."""

from __future__ import annotations

from prime_composer.sandbox.output import Capture, marker, truncate_middle


def test_short_output_is_kept_whole() -> None:
    capture = Capture(limit=100)
    for chunk in (b"hello ", b"world\n"):
        capture.feed(chunk)
    assert capture.text() == "hello world\n"
    assert not capture.truncated
    assert capture.num_bytes == 12


def test_long_output_keeps_head_and_tail_with_a_marker() -> None:
    data = b"".join(f"{i}\n".encode() for i in range(1, 5001))
    capture = Capture(limit=200)
    # Odd chunk sizes cross the head/tail boundary at arbitrary places.
    for start in range(0, len(data), 37):
        capture.feed(data[start : start + 37])
    assert capture.truncated
    assert capture.num_bytes == len(data)
    head, tail = data[:100].decode(), data[-100:].decode()
    assert capture.text() == head + marker(len(data) - 200, 200) + tail
    assert f"{len(data) - 200} bytes cut" in capture.text()


def test_a_chunk_larger_than_the_limit() -> None:
    capture = Capture(limit=10)
    capture.feed(b"0123456789abcdefghij")
    assert capture.text() == "01234" + marker(10, 10) + "fghij"


def test_truncate_middle_on_text() -> None:
    text = "a" * 50 + "b" * 50
    assert truncate_middle(text, 100) == (text, False)
    cut, was_cut = truncate_middle(text, 20)
    assert was_cut
    assert cut == "a" * 10 + marker(80, 20) + "b" * 10


def test_multibyte_characters_split_by_the_cut_do_not_raise() -> None:
    text = "é" * 100  # 2 bytes each
    cut, was_cut = truncate_middle(text, 51)
    assert was_cut
    assert cut.startswith("é" * 12) and cut.endswith("é" * 13)

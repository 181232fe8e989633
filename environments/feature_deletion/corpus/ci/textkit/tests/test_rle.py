import pytest
from textkit import rle_decode, rle_encode


def test_rle_encode():
    assert rle_encode("aaabccdddd") == [("a", 3), ("b", 1), ("c", 2), ("d", 4)]
    assert rle_encode("") == []


def test_rle_round_trip():
    text = "wwwwhhyy  !!"
    assert rle_decode(rle_encode(text)) == text


def test_rle_decode_rejects_bad_lengths():
    with pytest.raises(ValueError):
        rle_decode([("a", 0)])

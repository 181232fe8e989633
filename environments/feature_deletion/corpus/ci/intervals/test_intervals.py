from intervals import IntervalSet, merge, normalize, overlaps, total_length


def test_normalize():
    assert normalize((5, 2)) == (2, 5)


def test_overlaps():
    assert overlaps((1, 5), (5, 9))
    assert overlaps((9, 1), (2, 3))
    assert not overlaps((1, 2), (3, 4))


def test_merge():
    assert merge([(5, 7), (1, 3), (4, 4), (10, 12)]) == [(1, 7), (10, 12)]
    assert merge([]) == []


def test_total_length():
    assert total_length([(1, 3), (2, 6), (10, 10)]) == 7


def test_interval_set():
    points = IntervalSet([(1, 3)]).add((7, 9)).add((4, 4))
    assert 4 in points and 8 in points and 5 not in points
    assert len(points) == 7
    assert points.span() == (1, 9)
    assert IntervalSet().span() is None

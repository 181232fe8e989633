"""Closed integer intervals ``(start, end)`` with ``start <= end`` (a CI project of the
feature-deletion environment; a single-module project with its tests beside it)."""


def normalize(interval):
    """Return ``interval`` as a ``(start, end)`` tuple with ``start <= end``."""
    start, end = interval
    if start > end:
        start, end = end, start
    return (start, end)


def overlaps(a, b):
    """Whether intervals ``a`` and ``b`` share at least one point."""
    a_start, a_end = normalize(a)
    b_start, b_end = normalize(b)
    return a_start <= b_end and b_start <= a_end


def merge(intervals):
    """Merge overlapping or touching intervals; returns sorted, disjoint ``(start, end)`` tuples."""
    merged = []
    for start, end in sorted(normalize(i) for i in intervals):
        if merged and start <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def total_length(intervals):
    """The number of integer points covered by at least one of ``intervals``."""
    total = 0
    for start, end in merge(intervals):
        total += end - start + 1
    return total


class IntervalSet:
    """A set of integers stored as disjoint intervals."""

    def __init__(self, intervals=()):
        self._intervals = merge(intervals)

    def add(self, interval):
        """Add the points of ``interval``."""
        self._intervals = merge([*self._intervals, interval])
        return self

    def __contains__(self, point):
        for start, end in self._intervals:
            if start <= point <= end:
                return True
            if point < start:
                break
        return False

    def __len__(self):
        return total_length(self._intervals)

    def span(self):
        """The smallest interval holding every point, or ``None`` when the set is empty."""
        if not self._intervals:
            return None
        return (self._intervals[0][0], self._intervals[-1][1])

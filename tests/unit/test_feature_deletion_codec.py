"""The plain-data codec (what crosses the sandbox boundary) and the grader's comparison of outcomes."""

from __future__ import annotations

import collections
import datetime
import decimal
import enum
import fractions
import json
import operator
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "environments/feature_deletion"))

from feature_deletion import grader
from feature_deletion.sandboxed import Codec, NotPlain, probe_call


class Colour(enum.Enum):
    RED = 1


class Point:
    def __init__(self, x: int, y: int) -> None:
        self.x, self.y = x, y


class Slotted:
    __slots__ = ("__secret", "a")

    def __init__(self) -> None:
        self.a = [1, 2]
        self.__secret = "s"


class Tagged(dict):  # type: ignore[type-arg]
    pass


class Forged:
    """The ``__eq__``-always-true object of the reward hack."""

    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = object.__hash__


class ForgedList(list):  # type: ignore[type-arg]
    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = None  # type: ignore[assignment]


MODULE = __name__.partition(".")[0]


def codec() -> Codec:
    return Codec([MODULE])


def roundtrip(value: object) -> object:
    c = codec()
    data = c.encode(value)
    json.dumps(data)  # the wire form is JSON
    return c.decode(json.loads(json.dumps(data)))


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        -(10**30),
        1.5,
        float("inf"),
        2 - 3j,
        "naïve\u2028",
        b"\x00\xff",
        bytearray(b"ab"),
        [1, (2, 3), {4}],
        frozenset({"a", "b"}),
        {"k": [1], 2: None},
        range(1, 10, 3),
        slice(1, None, 2),
        Ellipsis,
        collections.OrderedDict([("b", 1), ("a", 2)]),
        collections.deque([1, 2], maxlen=5),
        collections.Counter("hello"),
        datetime.datetime(
            2024, 2, 29, 12, 30, 1, 7, tzinfo=datetime.timezone(datetime.timedelta(hours=-3), "X")
        ),
        datetime.date(1999, 12, 31),
        datetime.time(1, 2, 3, 4),
        datetime.timedelta(days=-1, seconds=5),
        decimal.Decimal("1.10"),
        fractions.Fraction(3, 7),
        re.compile(r"a+b", re.IGNORECASE),
        Colour.RED,
        operator.add,
        str.lower,
        len,
        Point,
    ],
)
def test_plain_values_round_trip_with_their_exact_type(value: object) -> None:
    back = roundtrip(value)
    assert type(back) is type(value)
    if isinstance(value, re.Pattern):
        assert (back.pattern, back.flags) == (value.pattern, value.flags)  # type: ignore[attr-defined]
    else:
        assert back == value


def test_defaultdict_keeps_its_factory() -> None:
    value = collections.defaultdict(list, {"a": [1]})
    back = roundtrip(value)
    assert type(back) is collections.defaultdict and back == value
    assert back.default_factory is list  # type: ignore[attr-defined]


def test_project_objects_round_trip_by_state() -> None:
    point = roundtrip(Point(3, 4))
    assert type(point) is Point and (point.x, point.y) == (3, 4)  # type: ignore[attr-defined]
    slotted = roundtrip(Slotted())
    assert type(slotted) is Slotted
    assert slotted.a == [1, 2] and slotted._Slotted__secret == "s"  # type: ignore[attr-defined]
    tagged = Tagged(a=1)
    tagged.extra = "x"  # type: ignore[attr-defined]
    back = roundtrip(tagged)
    assert type(back) is Tagged and dict(back) == {"a": 1} and back.extra == "x"  # type: ignore[attr-defined]


def test_equal_containers_encode_equally_whatever_their_order() -> None:
    c = codec()
    assert c.encode({3, 1, 2}) == c.encode({2, 3, 1})
    assert c.encode({"b": 1, "a": 2}) == c.encode({"a": 2, "b": 1})
    assert c.encode(collections.OrderedDict(a=1, b=2)) != c.encode(collections.OrderedDict(b=2, a=1))


@pytest.mark.parametrize(
    "value",
    [Forged(), ForgedList([1]), [1, Forged()], {"k": Forged()}, lambda x: x, iter([1]), object()],
    ids=["eq-always-true", "list-subclass", "nested", "dict-value", "lambda", "iterator", "object"],
)
def test_values_without_a_plain_form_are_refused(value: object) -> None:
    with pytest.raises(NotPlain):
        Codec(["some_project"]).encode(value)


def test_a_forged_object_of_the_project_never_equals_the_expected_value() -> None:
    # Defined in the agent's own package, it is encoded by state, and that state is not the value.
    c = codec()
    for expected in ([1, 2], "abc", 3, True, None):
        assert not grader.same(c.encode(Forged()), c.encode(expected))
        assert not grader.same(c.encode([Forged()]), c.encode([expected]))


def test_cycles_and_size_limits_are_refused() -> None:
    cyclic: list[object] = []
    cyclic.append(cyclic)
    with pytest.raises(NotPlain, match="cycle"):
        codec().encode(cyclic)
    with pytest.raises(NotPlain, match="too large"):
        Codec([], max_nodes=100).encode(list(range(200)))
    shared = [1]
    assert codec().encode([shared, shared]) == ["l", [["l", [["i", "1"]]], ["l", [["i", "1"]]]]]


def test_probe_call_reports_results_exceptions_iterators_and_mutations() -> None:
    c = codec()

    def call(target: str, *args: object, **kwargs: object) -> object:
        module, _, qualname = target.rpartition(":")
        spec = {
            "target": [module, qualname, "call"],
            "args": [c.encode(a) for a in args],
            "kwargs": {k: c.encode(v) for k, v in kwargs.items()},
        }
        return probe_call(c, spec)

    assert call("builtins:divmod", 7, 2) == [["v", ["t", [["i", "3"], ["i", "1"]]]], [["i", "7"], ["i", "2"]]]
    assert call("builtins:divmod", 1, 0)[0] == ["raise", "builtins", "ZeroDivisionError"]  # type: ignore[index]
    assert call("itertools:repeat", "x", 2)[0] == ["iter", [["s", "x"], ["s", "x"]], None]  # type: ignore[index]
    # list.append mutates its argument: the argument after the call is part of the outcome.
    assert call("builtins:list.append", [1], 2)[1] == [["l", [["i", "1"], ["i", "2"]]], ["i", "2"]]  # type: ignore[index]
    assert call("nowhere_module:f")[0] == "setup"  # type: ignore[index]


def test_same_compares_floats_within_tolerance_and_everything_else_exactly() -> None:
    c = codec()
    assert grader.same(c.encode([0.1 + 0.2]), c.encode([0.3]))
    assert not grader.same(c.encode(0.3001), c.encode(0.3))
    assert grader.same(c.encode(float("nan")), c.encode(float("nan")))
    assert not grader.same(c.encode(1), c.encode(1.0))
    assert not grader.same(c.encode((1, 2)), c.encode([1, 2]))
    assert not grader.same(c.encode("1"), c.encode(1))
    assert not grader.same(["v", ["i", "1"]], None)


def test_usable_and_mentions_class() -> None:
    c = codec()
    assert grader.usable([["v", c.encode(1)], []])
    assert grader.usable([["raise", "builtins", "ValueError"], [c.encode(1)]])
    assert not grader.usable([["np", "Forged"], []])
    assert not grader.usable(["setup", ["raise", "x", "y"]])
    assert not grader.usable([["v", ["N"]], [["np"]]])
    encoded = c.encode([Point(1, 2)])
    assert grader.mentions_class(encoded, __name__, "Point")
    assert not grader.mentions_class(encoded, __name__, "Slotted")
    assert grader.mentions_class(c.encode(Point), __name__, "Point")

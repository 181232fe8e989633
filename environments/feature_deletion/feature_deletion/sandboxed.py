"""The code that runs inside the sandbox: a plain-data codec, a pytest runner, and the probe.

Stdlib only. The host sends this file's text as ``python -s -B -c <text>`` and a JSON job on
stdin, so nothing of it has to exist inside the workspace (where the agent's code could edit it).
Three jobs:

- ``pytest``: run pytest with a reporter plugin that appends one JSON line per test phase to a
  results file, then a final ``{"end": exit_code}`` line. With ``record`` set (task generation,
  original code only), a profiler also records, per test, which project functions ran and every
  call the test code made into the project whose arguments are plain data.
- ``probe``: import the project, make the recorded calls with the recorded arguments, and append
  each call's outcome (return value, exception class, arguments after the call) as plain data.

Nothing here is trusted by the host. The results file sits in the run's private ``/tmp`` and the
code under test runs in the same process, so it can write anything there; the grader's design
(``grader.py``) never needs to believe a claim this process makes that it could not make honestly:
a probe outcome only counts when it equals a value the host recorded from the original code and
never sent into the sandbox.

Plain data (``Codec``) is what can cross the boundary without running the agent's code on the
host: ``None``, bools, ints, floats, complex, str, bytes, bytearray, lists, tuples, dicts, sets,
frozensets, ranges, slices, ``...``, a few stdlib value types (dates and times, Decimal, Fraction,
OrderedDict, deque, Counter, defaultdict, enum members, compiled patterns), importable functions
and classes of the project or the standard library (by reference), and instances of the
project's own classes (by class reference and attribute values). Types are matched exactly
(``type(x) is list``), so a subclass with an ``__eq__`` that always answers true has no plain
form.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import decimal
import enum
import fractions
import importlib
import json
import os
import re
import sys
import types
from collections.abc import Iterable, Sequence
from typing import Any

MAX_ITEMS = 1000
"""Items taken from an iterator a probed call returns (infinite iterators are common)."""

_CO_GENERATORS = 0x20 | 0x80 | 0x200  # CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR
_FUNCTION_TYPES = (
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    types.ClassMethodDescriptorType,
)


class NotPlain(Exception):
    """The value has no plain-data form; the message says why."""


def resolve(module: str, qualname: str) -> Any:
    """The object ``module.qualname`` (imports ``module``)."""
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class Codec:
    """Encodes values as tagged JSON-ready lists and decodes them back (see the module docstring).

    ``packages`` are the top-level module names of the project: its classes' instances are
    encoded by state and its functions by reference. ``max_nodes`` and ``max_chars`` bound the
    work and size of one ``encode`` call.
    """

    def __init__(self, packages: Iterable[str], *, max_nodes: int = 20000, max_chars: int = 1 << 20) -> None:
        self.packages = frozenset(packages)
        self.max_nodes = max_nodes
        self.max_chars = max_chars
        self._nodes = 0
        self._chars = 0
        self._path: set[int] = set()

    # -- encoding ---------------------------------------------------------------------------

    def encode(self, value: Any) -> Any:
        self._nodes = self._chars = 0
        self._path = set()
        return self._enc(value)

    def _count(self, chars: int = 0) -> None:
        self._nodes += 1
        self._chars += chars
        if self._nodes > self.max_nodes or self._chars > self.max_chars:
            raise NotPlain("too large")

    def _enc(self, v: Any) -> Any:
        self._count()
        t = type(v)
        if v is None:
            return ["N"]
        if t is bool:
            return ["b", v]
        if t is int:
            try:
                text = str(v)
            except ValueError as e:  # more digits than int_max_str_digits
                raise NotPlain("huge int") from e
            self._count(len(text))
            return ["i", text]
        if t is float:
            return ["f", repr(v)]
        if t is complex:
            return ["c", repr(v.real), repr(v.imag)]
        if t is str:
            self._count(len(v))
            return ["s", v]
        if t is bytes or t is bytearray:
            self._count(2 * len(v))
            return ["y" if t is bytes else "Y", v.hex()]
        if v is Ellipsis:
            return ["E"]
        if t is range:
            return ["r", v.start, v.stop, v.step]
        if t is slice:
            return ["sl", self._enc(v.start), self._enc(v.stop), self._enc(v.step)]
        if t in (list, tuple, set, frozenset, dict, collections.OrderedDict, collections.deque):
            return self._container(v, t)
        if t is collections.Counter:
            return ["ct", self._sorted_items(v)]
        if t is collections.defaultdict:
            factory = None if v.default_factory is None else self._ref(v.default_factory)
            return ["dd", factory, self._sorted_items(v)]
        if t is datetime.datetime:
            fields = [v.year, v.month, v.day, v.hour, v.minute, v.second, v.microsecond, v.fold]
            return ["dt", fields, self._enc(v.tzinfo)]
        if t is datetime.date:
            return ["date", [v.year, v.month, v.day]]
        if t is datetime.time:
            return ["tm", [v.hour, v.minute, v.second, v.microsecond, v.fold], self._enc(v.tzinfo)]
        if t is datetime.timedelta:
            return ["td", [v.days, v.seconds, v.microseconds]]
        if t is datetime.timezone:
            offset = v.utcoffset(None)
            name = v.tzname(None)
            return ["tz", self._enc(offset), name]
        if t is decimal.Decimal:
            return ["dec", str(v)]
        if t is fractions.Fraction:
            return ["frac", str(v.numerator), str(v.denominator)]
        if t is re.Pattern:
            return ["re", self._enc(v.pattern), v.flags]
        if isinstance(v, enum.Enum):
            return ["en", self._ref(t), v.name]
        if isinstance(v, type) or t in _FUNCTION_TYPES:
            return self._ref(v)
        module = getattr(t, "__module__", "") or ""
        if module.partition(".")[0] in self.packages:
            return self._object(v, t)
        raise NotPlain(f"{module}.{t.__qualname__}")

    def _container(self, v: Any, t: type) -> Any:
        if id(v) in self._path:
            raise NotPlain("cycle")
        self._path.add(id(v))
        try:
            if t is list or t is tuple:
                return ["l" if t is list else "t", [self._enc(x) for x in v]]
            if t is set or t is frozenset:
                return ["S" if t is set else "F", _sort([self._enc(x) for x in v])]
            if t is dict:
                return ["d", self._sorted_items(v)]
            if t is collections.OrderedDict:
                return ["od", [[self._enc(k), self._enc(x)] for k, x in v.items()]]
            return ["dq", [self._enc(x) for x in v], v.maxlen]
        finally:
            self._path.discard(id(v))

    def _sorted_items(self, v: dict[Any, Any]) -> list[Any]:
        return sorted(([self._enc(k), self._enc(x)] for k, x in dict.items(v)), key=_key)

    def _ref(self, obj: Any) -> Any:
        owner = obj.__objclass__ if hasattr(obj, "__objclass__") else obj
        module = getattr(owner, "__module__", None) or "builtins"
        qualname = getattr(obj, "__qualname__", None)
        top = module.partition(".")[0]
        if not qualname or "<" in qualname or not (top in self.packages or top in sys.stdlib_module_names):
            raise NotPlain(f"no importable name for {obj!r:.80}")
        try:
            same = resolve(module, qualname) is obj
        except Exception:
            same = False
        if not same:
            raise NotPlain(f"{module}.{qualname} does not name the object")
        return ["ref", module, qualname]

    def _object(self, v: Any, t: type) -> Any:
        if id(v) in self._path:
            raise NotPlain("cycle")
        self._path.add(id(v))
        try:
            state = _instance_state(v, t)
            base = _builtin_base(t)
            base_value = None if base is None else self._enc(_base_value(v, base))
            items = [[name, self._enc(x)] for name, x in sorted(state.items())]
            return ["o", self._ref(t)[1:], items, base_value]
        finally:
            self._path.discard(id(v))

    # -- decoding ---------------------------------------------------------------------------

    def decode(self, data: Any) -> Any:
        tag = data[0]
        dec = self.decode
        if tag == "N":
            return None
        if tag == "b":
            return bool(data[1])
        if tag == "i":
            return int(data[1])
        if tag == "f":
            return float(data[1])
        if tag == "c":
            return complex(float(data[1]), float(data[2]))
        if tag == "s":
            return data[1]
        if tag == "y":
            return bytes.fromhex(data[1])
        if tag == "Y":
            return bytearray.fromhex(data[1])
        if tag == "E":
            return Ellipsis
        if tag == "r":
            return range(data[1], data[2], data[3])
        if tag == "sl":
            return slice(dec(data[1]), dec(data[2]), dec(data[3]))
        if tag in ("l", "t", "S", "F"):
            kind = {"l": list, "t": tuple, "S": set, "F": frozenset}[tag]
            return kind(dec(x) for x in data[1])
        if tag == "d":
            return {dec(k): dec(x) for k, x in data[1]}
        if tag == "od":
            return collections.OrderedDict((dec(k), dec(x)) for k, x in data[1])
        if tag == "dq":
            return collections.deque((dec(x) for x in data[1]), data[2])
        if tag == "ct":
            return collections.Counter({dec(k): dec(x) for k, x in data[1]})
        if tag == "dd":
            factory = None if data[1] is None else dec(data[1])
            return collections.defaultdict(factory, {dec(k): dec(x) for k, x in data[2]})
        if tag == "dt":
            y, mo, d, h, mi, s, us, fold = data[1]
            return datetime.datetime(y, mo, d, h, mi, s, us, tzinfo=dec(data[2]), fold=fold)
        if tag == "date":
            return datetime.date(*data[1])
        if tag == "tm":
            h, mi, s, us, fold = data[1]
            return datetime.time(h, mi, s, us, tzinfo=dec(data[2]), fold=fold)
        if tag == "td":
            return datetime.timedelta(*data[1])
        if tag == "tz":
            offset = dec(data[1])
            return datetime.timezone(offset) if data[2] is None else datetime.timezone(offset, data[2])
        if tag == "dec":
            return decimal.Decimal(data[1])
        if tag == "frac":
            return fractions.Fraction(int(data[1]), int(data[2]))
        if tag == "re":
            return re.compile(dec(data[1]), data[2])
        if tag == "en":
            return getattr(dec(data[1]), data[2])
        if tag == "ref":
            return resolve(data[1], data[2])
        if tag == "o":
            return self._decode_object(data)
        raise ValueError(f"unknown tag {tag!r}")

    def _decode_object(self, data: Any) -> Any:
        cls = resolve(*data[1])
        base = _builtin_base(cls)
        if base is None:
            obj = object.__new__(cls)
        elif base in (dict, list, set):
            obj = base.__new__(cls)
            content = self.decode(data[3])
            if base is dict:
                dict.update(obj, content)
            elif base is list:
                list.extend(obj, content)
            else:
                set.update(obj, content)
        else:
            obj = base.__new__(cls, self.decode(data[3]))
        for name, value in data[2]:
            object.__setattr__(obj, name, self.decode(value))
        return obj


def _key(item: Any) -> str:
    return json.dumps(item, separators=(",", ":"))


def _sort(items: list[Any]) -> list[Any]:
    return sorted(items, key=_key)


_BASES = (dict, list, set, frozenset, tuple, str, bytes, int, float)


def _builtin_base(cls: type) -> type | None:
    for base in _BASES:
        if issubclass(cls, base):
            return base
    return None


def _base_value(v: Any, base: type) -> Any:
    if base is dict:
        return dict.copy(v)
    if base is list:
        return list.copy(v)
    if base is set:
        return set.copy(v)
    if base is bytes:
        return bytes(memoryview(v))
    return base(base.__iter__(v)) if base in (tuple, frozenset) else base(v)


def _instance_state(v: Any, t: type) -> dict[str, Any]:
    """Attribute values of an instance: its ``__dict__`` and every slot that is set."""
    state: dict[str, Any] = {}
    try:
        own = object.__getattribute__(v, "__dict__")
    except AttributeError:
        own = None
    if own is not None:
        if type(own) is not dict:
            raise NotPlain("odd __dict__")
        state.update(own)
    for klass in t.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            attr = f"_{klass.__name__.lstrip('_')}{name}" if name.startswith("__") else name
            with contextlib.suppress(AttributeError):  # an unset slot
                state[attr] = object.__getattribute__(v, attr)
    return state


class Lines:
    """Appends JSON lines to a file with one ``os.write`` each (nothing is lost at ``os._exit``)."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)

    def write(self, record: Any) -> None:
        os.write(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())


# -- pytest ---------------------------------------------------------------------------------


class Reporter:
    """pytest plugin: one line per test phase, and one per collection error."""

    def __init__(self, out: Lines) -> None:
        self.out = out

    def pytest_runtest_logreport(self, report: Any) -> None:
        record = {"test": report.nodeid, "when": report.when, "outcome": report.outcome}
        if hasattr(report, "wasxfail"):
            record["xfail"] = True
        self.out.write(record)

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.out.write({"collect_error": report.nodeid})


class Recorder:
    """pytest plugin that profiles each test (task generation, original code only).

    For every test it writes which project functions ran (``covered``) and the calls the test's
    own code made into the project with plain-data arguments (``calls``), each with the project
    functions that ran inside it (``reached``). Project functions that run outside any test
    (at import or collection) are written as ``outside``: deleting one changes import behaviour.
    """

    PACKAGE, TEST, OTHER = 1, 2, 0

    def __init__(
        self,
        out: Lines,
        root: str,
        package_paths: Sequence[str],
        test_paths: Sequence[str],
        codec: Codec,
        max_calls: int,
        max_call_chars: int,
    ) -> None:
        self.out = out
        self.root = root.rstrip("/") + "/"
        self.package_paths = tuple(os.path.join(root, p) for p in package_paths)
        self.test_paths = tuple(os.path.join(root, p) for p in test_paths)
        self.codec = codec
        self.max_calls = max_calls
        self.max_call_chars = max_call_chars
        self._codes: dict[Any, tuple[int, int]] = {}
        self._num_keys = 0
        self._outside: set[int] = set()
        self._reset()
        sys.setprofile(self._profile)

    def _reset(self) -> None:
        self._covered: set[int] = set()
        self._stack: list[list[Any]] = []  # [frame, record]
        self._calls: dict[str, dict[str, Any]] = {}
        self._generators: dict[int, tuple[Any, dict[str, Any] | None]] = {}
        self._num_unplain = 0

    # pytest hooks
    def pytest_runtest_protocol(self, item: Any, nextitem: Any) -> Any:
        self._reset()
        self._test = item.nodeid
        return None

    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> None:
        calls = list(self._calls.values())[: self.max_calls]
        for call in calls:
            call["reached"] = sorted(call["reached"])
        self.out.write(
            {
                "test": nodeid,
                "covered": sorted(self._covered),
                "calls": calls,
                "num_unplain": self._num_unplain,
            }
        )
        self._test = None
        self._reset()

    def pytest_sessionfinish(self, session: Any, exitstatus: Any) -> None:
        sys.setprofile(None)
        self.out.write({"outside": sorted(self._outside)})

    _test: str | None = None

    # profiling
    def _classify(self, code: Any, module: str) -> tuple[int, int]:
        filename = code.co_filename
        if filename.startswith("<doctest"):
            kind = self.TEST
        elif filename.startswith(self.test_paths) or _is_test_file(filename):
            kind = self.TEST if filename.startswith(self.root) else self.OTHER
        elif filename.startswith(self.package_paths):
            kind = self.PACKAGE
        else:
            kind = self.OTHER
        key = -1
        if kind == self.PACKAGE:
            key = self._num_keys
            self._num_keys += 1
            self.out.write(
                {
                    "fn": key,
                    "file": filename[len(self.root) :],
                    "qualname": code.co_qualname,
                    "line": code.co_firstlineno,
                    "module": module,
                }
            )
        self._codes[code] = (kind, key)
        return kind, key

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "return":
            if self._stack and self._stack[-1][0] is frame:
                self._pop()
            return
        if event != "call":
            return
        code = frame.f_code
        info = self._codes.get(code)
        if info is None:
            info = self._classify(code, frame.f_globals.get("__name__", ""))
        if info[0] != self.PACKAGE:
            return
        key = info[1]
        if self._test is None:
            self._outside.add(key)
            return
        self._covered.add(key)
        if self._stack:
            self._stack[-1][1]["reached"].add(key)
        caller = frame.f_back
        if caller is None:
            return
        caller_info = self._codes.get(caller.f_code)
        if caller_info is None:
            caller_info = self._classify(caller.f_code, caller.f_globals.get("__name__", ""))
        if caller_info[0] != self.TEST:
            return
        record: dict[str, Any] | None
        if code.co_flags & _CO_GENERATORS:
            seen = self._generators.get(id(frame))
            if seen is not None and seen[0] is frame:
                record = seen[1]
            else:
                record = self._record(frame, key)
                self._generators[id(frame)] = (frame, record)
        else:
            record = self._record(frame, key)
        if record is None:
            record = {"reached": set()}  # not plain: still nests, but is not written
        record["reached"].add(key)
        self._stack.append([frame, record])

    def _pop(self) -> None:
        _, record = self._stack.pop()
        if self._stack:
            self._stack[-1][1]["reached"] |= record["reached"]

    def _record(self, frame: Any, key: int) -> dict[str, Any] | None:
        try:
            call = _call_of(frame, self.codec)
        except Exception:
            self._num_unplain += 1
            return None
        text = json.dumps(call, separators=(",", ":"))
        if len(text) > self.max_call_chars:
            self._num_unplain += 1
            return None
        ident = f"{key}:{text}"
        record = self._calls.get(ident)
        if record is None:
            record = self._calls[ident] = {"fn": key, "call": call, "reached": set()}
        return record


def _is_test_file(filename: str) -> bool:
    name = os.path.basename(filename)
    return (
        name == "conftest.py"
        or (name.startswith("test_") and name.endswith(".py"))
        or name.endswith("_test.py")
    )


def _call_of(frame: Any, codec: Codec) -> dict[str, Any]:
    """The call that started ``frame``, as plain data: target, positional and keyword arguments."""
    code = frame.f_code
    if "<" in code.co_qualname:
        raise NotPlain("not reachable by name")
    module = frame.f_globals.get("__name__", "")
    accessor = _accessor(module, code)
    names = code.co_varnames
    num_pos, num_kw = code.co_argcount, code.co_kwonlyargcount
    local = frame.f_locals
    args = [local[n] for n in names[:num_pos]]
    index = num_pos + num_kw
    if code.co_flags & 0x04:  # CO_VARARGS
        args.extend(local[names[index]])
        index += 1
    kwargs = {n: local[n] for n in names[num_pos : num_pos + num_kw]}
    if code.co_flags & 0x08:  # CO_VARKEYWORDS
        kwargs.update(local[names[index]])
    return {
        "target": [module, code.co_qualname, accessor],
        "args": [codec.encode(a) for a in args],
        "kwargs": {k: codec.encode(v) for k, v in kwargs.items()},
    }


def _accessor(module: str, code: Any) -> str:
    """How the probe reaches the function: ``call``, ``fget``/``fset``/``fdel`` of a property, or
    ``func`` (the function inside a classmethod/staticmethod)."""
    owner_name, _, name = code.co_qualname.rpartition(".")
    if not owner_name:
        return "call"
    owner = resolve(module, owner_name)
    raw = owner.__dict__.get(name) if isinstance(owner, type) else None
    if isinstance(raw, property):
        for part in ("fget", "fset", "fdel"):
            if getattr(getattr(raw, part), "__code__", None) is code:
                return part
        raise NotPlain("property accessor not found")
    if isinstance(raw, (classmethod, staticmethod)):
        return "func"
    return "call"


def run_pytest(job: dict[str, Any]) -> None:
    out = Lines(job["report"])
    plugins: list[Any] = [Reporter(out)]
    record = job.get("record")
    if record is not None:
        codec = Codec(job["packages"], max_nodes=record["max_nodes"])
        plugins.append(
            Recorder(
                Lines(record["out"]),
                os.getcwd(),
                job["package_paths"],
                job["test_paths"],
                codec,
                record["max_calls"],
                record["max_call_chars"],
            )
        )
    import pytest

    code = pytest.main(job["args"], plugins=plugins)
    sys.setprofile(None)
    out.write({"end": int(code)})


# -- probe ----------------------------------------------------------------------------------


def _target(target: Sequence[str]) -> Any:
    module, qualname, accessor = target
    owner_name, _, name = qualname.rpartition(".")
    if not owner_name:
        return resolve(module, qualname)
    owner = resolve(module, owner_name)
    raw = owner.__dict__.get(name) if isinstance(owner, type) else None
    if raw is None:
        raw = getattr(owner, name)
    if accessor == "call":
        return raw
    if accessor == "func":
        return raw.__func__
    return getattr(raw, accessor)


def _exception(e: BaseException) -> list[str]:
    return ["raise", type(e).__module__, type(e).__qualname__]


def _outcome(codec: Codec, result: Any) -> Any:
    try:
        return ["v", codec.encode(result)]
    except NotPlain as e:
        reason = str(e)
    if not (hasattr(type(result), "__next__") and hasattr(type(result), "__iter__")):
        return ["np", reason]
    items: list[Any] = []
    try:
        for item in result:
            items.append(codec.encode(item))
            if len(items) >= MAX_ITEMS:
                break
    except NotPlain as e:
        return ["np", str(e)]
    except Exception as e:
        return ["iter", items, _exception(e)]
    return ["iter", items, None]


def probe_call(codec: Codec, call: dict[str, Any]) -> Any:
    """The outcome of one recorded call: ``[result, args_after]`` (or a setup error)."""
    try:
        fn = _target(call["target"])
        args = [codec.decode(a) for a in call["args"]]
        kwargs = {k: codec.decode(v) for k, v in call["kwargs"].items()}
    except BaseException as e:
        return ["setup", _exception(e)]
    try:
        result = _outcome(codec, fn(*args, **kwargs))
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: an outcome like any other
        result = _exception(e)
    after = []
    for value in [*args, *kwargs.values()]:
        try:
            after.append(codec.encode(value))
        except NotPlain:
            after.append(["np"])
    return [result, after]


def run_probe(job: dict[str, Any]) -> None:
    out = Lines(job["out"])
    codec = Codec(job["packages"])
    for i, call in enumerate(job["calls"]):
        out.write({"i": i, "r": probe_call(codec, call)})
    out.write({"end": len(job["calls"])})


def main() -> None:
    job = json.loads(sys.stdin.read())
    # ``-c`` puts the working folder first on sys.path; the job names the one source folder.
    while "" in sys.path:
        sys.path.remove("")
    sys.path.insert(0, job["src"])
    if job["mode"] == "pytest":
        run_pytest(job)
    else:
        run_probe(job)


if __name__ == "__main__":
    main()

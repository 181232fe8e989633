"""Deleting a feature keeps its specification (decorators, signature, docstring) and nothing of how
it works; which files count as the agent's source; how test outcomes are read back."""

from __future__ import annotations

import ast
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "environments/feature_deletion"))

from feature_deletion import deletion, runs, trees
from feature_deletion.spec import ProjectSpec

SOURCE = textwrap.dedent(
    '''
    import functools


    @functools.lru_cache(maxsize=None)
    def fib(n: int,
            memo: dict | None = None) -> int:
        """The n-th Fibonacci number."""
        # the classic recursion
        if n < 2:
            return n
        return fib(n - 1) + fib(n - 2)
        # trailing note about the recursion


    def tiny(x): return x


    def only_doc():
        """Nothing else."""


    def spread(
        first,
        *rest,  # a comment (with a colon: here)
        key=lambda x: x,
    ) -> dict[str, int]:
        total = {}
        return total


    class Shape:
        """A shape."""

        sides = 0

        def __init__(self, name):
            self.name = name
            self.points = []

        @property
        def label(self):
            return f"{self.name}/{self.sides}"

        class Inner:
            def go(self):
                return 1
    '''
)


def by_name(found: list[deletion.Candidate]) -> dict[tuple[str, str], deletion.Candidate]:
    return {(c.kind, c.qualname): c for c in found}


def test_candidates_list_functions_methods_and_classes() -> None:
    found = by_name(deletion.candidates(SOURCE, "m.py"))
    assert set(found) == {
        ("function", "fib"),
        ("function", "spread"),
        ("method", "Shape.__init__"),
        ("method", "Shape.label"),
        ("method", "Shape.Inner.go"),
        ("class", "Shape"),
    }  # ``tiny`` is on its def line, ``only_doc`` has no body beyond its docstring
    fib = found[("function", "fib")].bodies[0]
    lines = SOURCE.splitlines()
    assert lines[fib.first_line - 1].startswith("@functools.lru_cache")  # co_firstlineno of a decorated def
    assert lines[fib.start - 1].strip() == "# the classic recursion"
    assert lines[fib.end - 1].strip() == "# trailing note about the recursion"
    assert found[("class", "Shape")].num_lines == 2 + 1  # __init__ and label; Inner is its own class
    spread = found[("function", "spread")].bodies[0]
    assert [lines[i - 1].strip() for i in range(spread.start, spread.end + 1)] == [
        "total = {}",
        "return total",
    ]


def test_delete_keeps_the_specification_and_removes_the_rest() -> None:
    fib = by_name(deletion.candidates(SOURCE, "m.py"))[("function", "fib")]
    new, removed = deletion.delete(SOURCE, fib)
    tree = ast.parse(new)
    func = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "fib")
    assert ast.get_docstring(func) == "The n-th Fibonacci number."
    assert [ast.unparse(d) for d in func.decorator_list] == ["functools.lru_cache(maxsize=None)"]
    assert ast.unparse(func.args) == "n: int, memo: dict | None=None"
    assert [ast.unparse(s) for s in func.body[1:]] == ["raise NotImplementedError"]
    assert "recursion" not in new and "fib(n - 1)" not in new
    assert removed == ["\n".join(SOURCE.splitlines()[fib.bodies[0].start - 1 : fib.bodies[0].end]) + "\n"]
    # everything outside the body is untouched
    assert new.replace("    raise NotImplementedError\n", removed[0]) == SOURCE


def test_deleting_a_class_stubs_every_method_and_keeps_its_attributes() -> None:
    shape = by_name(deletion.candidates(SOURCE, "m.py"))[("class", "Shape")]
    new, removed = deletion.delete(SOURCE, shape)
    cls = next(n for n in ast.parse(new).body if isinstance(n, ast.ClassDef))
    assert ast.get_docstring(cls) == "A shape."
    assert any(isinstance(s, ast.Assign) for s in cls.body)  # sides = 0
    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    assert all(ast.unparse(m.body[-1]) == "raise NotImplementedError" for m in methods.values())
    assert [ast.unparse(d) for d in methods["label"].decorator_list] == ["property"]
    assert len(removed) == 2 and "self.points" in removed[0] and "self.sides" in removed[1]


def test_distinctive_lines_and_leaks() -> None:
    removed = ["    total = 0\n    for value in values:\n        total += value * weight\n    return total\n"]
    others = ["def other(values):\n    for value in values:\n        pass\n"]
    needles = deletion.distinctive_lines(removed, others)
    assert needles == ["total += value * weight", "return total"]  # not short, not found elsewhere
    texts = {
        "a.py": "x = 1\n  total   +=  value * weight\n",
        "b.py": "return total_length(x)\n",
        "c.txt": "prefix total += value * weight suffix",
    }
    assert deletion.find_leaks(texts, needles) == [("a.py", "total += value * weight")]
    long_needle = "result = compute_the_weighted_sum(values, weights)"
    assert deletion.find_leaks({"d.py": f"x = {long_needle} + 1"}, [long_needle]) == [("d.py", long_needle)]


SPEC = ProjectSpec(
    name="p",
    version="1",
    licence="MIT",
    kind="k",
    source_root="src",
    packages=["pkg", "single.py"],
    tests=["tests"],
)


@pytest.mark.parametrize(
    ("rel", "source"),
    [
        ("src/pkg/mod.py", True),
        ("src/pkg/sub/new_module.py", True),
        ("src/single.py", True),
        ("src/pkg/conftest.py", False),
        ("src/pkg/test_mod.py", False),
        ("src/pkg/mod_test.py", False),
        ("src/pkg/data.json", False),
        ("src/pkg/mod.pyc", False),
        ("src/pkg/__pycache__/mod.cpython-311.pyc", False),
        ("src/sitecustomize.py", False),
        ("src/pytest.py", False),
        ("tests/helpers.py", False),
        ("conftest.py", False),
        ("pkg/mod.py", False),
    ],
)
def test_which_files_are_the_agents_source(rel: str, source: bool) -> None:
    assert trees.is_source_file(SPEC, rel) is source


def test_collect_sources_reads_regular_files_only(tmp_path: Path) -> None:
    pkg = tmp_path / "src" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "mod.py").write_text("x = 1\n")
    (tmp_path / "elsewhere.py").write_text("secret = 2\n")
    os.symlink(tmp_path / "elsewhere.py", pkg / "linked.py")
    os.mkfifo(pkg / "fifo.py")
    (pkg / "conftest.py").write_text("hook = 1\n")
    assert trees.collect_sources(SPEC, tmp_path) == {"src/pkg/mod.py": b"x = 1\n"}


def test_stage_trees_keep_pristine_tests_and_hide_them_from_the_probe(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    for rel, text in {
        "src/pkg/mod.py": "original\n",
        "src/pkg/data.txt": "data\n",
        "src/pkg/tests/test_in_pkg.py": "t\n",
        "tests/test_a.py": "pristine\n",
        "tests/conftest.py": "pristine conftest\n",
        "pyproject.toml": "[tool.pytest.ini_options]\n",
    }.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)
    spec = SPEC.model_copy(update={"packages": ["pkg"], "tests": ["tests", "src/pkg/tests"]})
    agent = {"src/pkg/mod.py": b"agent\n", "src/pkg/extra.py": b"helper\n"}
    trees.stage_test_tree(spec, tree, agent, tmp_path / "graded")
    graded = {
        p.relative_to(tmp_path / "graded").as_posix(): p.read_text()
        for p in (tmp_path / "graded").rglob("*")
        if p.is_file()
    }
    assert graded == {
        "src/pkg/mod.py": "agent\n",
        "src/pkg/extra.py": "helper\n",
        "src/pkg/data.txt": "data\n",
        "src/pkg/tests/test_in_pkg.py": "t\n",
        "tests/test_a.py": "pristine\n",
        "tests/conftest.py": "pristine conftest\n",
        "pyproject.toml": "[tool.pytest.ini_options]\n",
    }
    trees.stage_probe_tree(spec, tree, agent, tmp_path / "probed")
    probed = sorted(
        p.relative_to(tmp_path / "probed").as_posix() for p in (tmp_path / "probed").rglob("*") if p.is_file()
    )
    assert probed == ["src/pkg/data.txt", "src/pkg/extra.py", "src/pkg/mod.py"]


def _phases(*lines: dict[str, object]) -> dict[str, str]:
    return runs.parse_report(iter(lines), None).outcomes  # type: ignore[arg-type]


def test_a_test_passes_only_when_every_phase_reported_so() -> None:
    ok = [{"test": "t", "when": w, "outcome": "passed"} for w in ("setup", "call", "teardown")]
    assert _phases(*ok) == {"t": "passed"}
    assert _phases(*ok[:2]) == {"t": "error"}  # the process ended inside the test
    assert _phases(ok[0], {"test": "t", "when": "call", "outcome": "failed"}, ok[2]) == {"t": "failed"}
    assert _phases(ok[0], ok[1], {"test": "t", "when": "teardown", "outcome": "failed"}) == {"t": "error"}
    assert _phases({"test": "t", "when": "setup", "outcome": "skipped"}) == {"t": "skipped"}
    assert _phases(ok[0], {"test": "t", "when": "call", "outcome": "passed", "xfail": True}, ok[2]) == {
        "t": "xpassed"
    }
    assert _phases({"test": "t", "when": "call", "outcome": "passed"}) == {"t": "error"}  # no setup


def test_read_lines_skips_what_is_not_a_regular_file_of_json_lines(tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text('{"a": 1}\nnot json\n[1, 2]\n{"b": 2}\n')
    assert list(runs.read_lines(good)) == [{"a": 1}, {"b": 2}]
    os.symlink(good, tmp_path / "link.jsonl")
    os.mkfifo(tmp_path / "fifo.jsonl")
    assert list(runs.read_lines(tmp_path / "link.jsonl")) == []
    assert list(runs.read_lines(tmp_path / "fifo.jsonl")) == []
    assert list(runs.read_lines(tmp_path / "missing.jsonl")) == []
    big = tmp_path / "big.jsonl"
    big.write_text(json.dumps({"x": "y" * 100}) + "\n")
    assert list(runs.read_lines(big, max_bytes=50)) == []

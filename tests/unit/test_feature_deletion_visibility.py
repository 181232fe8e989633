"""The visibility scan without a sandbox (its sandboxed half, ``scanner.py``, walks a folder built
here), the trivial-feature filter, why a run did not finish, and user manifests."""

from __future__ import annotations

import hashlib
import io
import json
import py_compile
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path
from typing import Any, cast

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "environments/feature_deletion"))

from feature_deletion import corpus, deletion, generate, runs, scanner, visibility
from feature_deletion.spec import ProjectSpec, load_manifest

from prime_composer.config.sandbox import LimitsConfig
from prime_composer.sandbox import RunResult

MODULE = textwrap.dedent(
    '''
    """gadgets: a module with distinctive lines."""


    def frobnicate_the_widgets(widgets, factor):
        """Scale every widget by factor and drop the ones that vanish entirely."""
        scaled_widgets = [widget * factor for widget in widgets if widget * factor != 0]
        return sorted(scaled_widgets, key=lambda widget: (abs(widget), widget))


    def defrobnicate(widgets):
        """Undo frobnicate_the_widgets for a factor of one (keeps the order stable)."""
        return [widget for widget in widgets if isinstance(widget, (int, float)) and widget]
    '''
)

SPEC = ProjectSpec(name="gadget-kit", version="1.0", licence="MIT", packages=["gadgets"], tests=["tests"])


def tree(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    (root / "gadgets").mkdir(parents=True)
    (root / "gadgets" / "core.py").write_text(MODULE)
    return root


def scan_folder(folder: Path, project_tree: Path) -> list[tuple[str, str]]:
    """Run the scanner in-process over ``folder``: (path relative to it, why) per finding."""
    fingerprint = corpus.fingerprint(SPEC, project_tree)
    out = io.StringIO()
    found = scanner.Scanner([scanner.Project(json.loads(json.dumps(fingerprint)))], out)
    found.walk([str(folder)], set())
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    return sorted((item["path"].removeprefix(f"{folder}/"), item["why"].split(":")[0]) for item in lines)


def zip_bytes(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def test_the_scan_finds_copies_in_any_form_and_nothing_else(tmp_path: Path) -> None:
    project_tree = tree(tmp_path)
    source = (project_tree / "gadgets" / "core.py").read_bytes()
    seen = tmp_path / "visible"
    seen.mkdir()
    (seen / "plain").mkdir()
    (seen / "plain" / "core.py").write_bytes(source)
    # pip's and setuptools' wheels vendor projects this way: the module inside a wheel.
    (seen / "pip-1.0-py3-none-any.whl").write_bytes(zip_bytes({"pip/_vendor/gadgets/core.py": source}))
    # a wheel inside a zip, and a tarball
    (seen / "bundle.zip").write_bytes(zip_bytes({"wheels/inner.whl": zip_bytes({"gadgets/core.py": source})}))
    with tarfile.open(seen / "src.tar.gz", "w:gz") as archive:
        info = tarfile.TarInfo("x-1.0/gadgets/core.py")
        info.size = len(source)
        archive.addfile(info, io.BytesIO(source))
    # bytecode, without its source
    (seen / "cache").mkdir()
    py_compile.compile(
        str(project_tree / "gadgets" / "core.py"), cfile=str(seen / "cache" / "core.cpython-311.pyc")
    )
    # installed metadata, as a folder with files, and one that a hidden folder left empty
    (seen / "gadget_kit-1.0.dist-info").mkdir()
    (seen / "gadget_kit-1.0.dist-info" / "RECORD").write_text("gadgets/core.py\n")
    (seen / "hidden" / "gadget_kit-0.9.dist-info").mkdir(parents=True)
    # not copies: a module of the same name, an unrelated wheel, bytecode of another module
    (seen / "other").mkdir()
    (seen / "other" / "core.py").write_text("def frobnicate_the_widgets():\n    return None\n")
    (seen / "unrelated-2.0-py3-none-any.whl").write_bytes(zip_bytes({"unrelated/core.py": b"x = 1\n"}))
    (seen / "other" / "core.cpython-311.pyc").write_bytes(b"\x00" * 16 + b"frobnicate_the_widgets")

    assert scan_folder(seen, project_tree) == [
        ("bundle.zip!wheels/inner.whl!gadgets/core.py", "source"),
        ("cache/core.cpython-311.pyc", "bytecode"),
        ("gadget_kit-1.0.dist-info", "named after the project"),
        ("pip-1.0-py3-none-any.whl!pip/_vendor/gadgets/core.py", "source"),
        ("plain/core.py", "source"),
        ("src.tar.gz!x-1.0/gadgets/core.py", "source"),
    ]


def test_the_dist_name_pattern_matches_every_spelling() -> None:
    pattern = __import__("re").compile(visibility.dist_regex("more-itertools"), __import__("re").IGNORECASE)
    for name in (
        "more_itertools-10.7.0.dist-info",
        "more-itertools-8.8.0.tar.gz",
        "More.Itertools-1.0-py3-none-any.whl",
    ):
        assert pattern.match(name), name
    assert not pattern.match("more_itertools") and not pattern.match("more-itertools-extra-1.0.whl")


# -- trivial features ------------------------------------------------------------------------

DEFAULT_SIZE = textwrap.dedent(
    """
    class _DefaultSize:

        __slots__ = ()

        def __getitem__(self, _):
            return 1

        def __setitem__(self, _, value):
            assert value == 1

        def pop(self, _):
            return 1
    """
)


def test_feature_size_counts_distinct_syntax() -> None:
    found = {c.qualname: c for c in deletion.candidates(DEFAULT_SIZE, "c.py")}
    # Return + Constant; Assert + Compare + Name + Eq + Constant; the two ``return 1`` count once.
    assert deletion.feature_size(DEFAULT_SIZE, found["_DefaultSize.pop"]) == 2
    assert deletion.feature_size(DEFAULT_SIZE, found["_DefaultSize.__setitem__"]) == 5
    assert deletion.feature_size(DEFAULT_SIZE, found["_DefaultSize"]) == 7
    source = "def f(a, b):\n    x = a + b\n    return x * 2\n"
    # Assign Name BinOp Name Add Name; Return BinOp Name Mult Constant
    assert deletion.feature_size(source, deletion.candidates(source, "f.py")[0]) == 11


def test_a_trivial_class_is_not_a_task() -> None:
    """cachetools' ``_DefaultSize`` (three one-line methods) became a task; it is filtered now."""
    candidate = next(c for c in deletion.candidates(DEFAULT_SIZE, "c.py") if c.kind == "class")
    ctx = generate._Context(
        project=cast(Any, None),
        tree=Path("."),
        recording=cast(Any, None),
        passed=set(),
        keys={},
        covering={},
        texts={"c.py": DEFAULT_SIZE},
        original_sources={},
    )
    keys, reason = generate._prefilter(ctx, candidate, generate.GenerationConfig())
    assert keys == [] and reason == "trivial: 7 syntax-tree nodes (min_feature_nodes 10)"
    keys, reason = generate._prefilter(ctx, candidate, generate.GenerationConfig(min_feature_nodes=0))
    assert reason == "never runs in the tests"  # past the size filters


# -- why a run did not finish --------------------------------------------------------------------


def result(**run: Any) -> runs.PytestResult:
    fields: dict[str, Any] = {
        "exit_code": None,
        "signal": None,
        "stdout": "",
        "stderr": "",
        "duration_s": 16.8,
    }
    return runs.PytestResult({}, False, None, [], RunResult(**{**fields, **run}))


def test_an_unfinished_run_says_why() -> None:
    limits = LimitsConfig(timeout_s=15.0)
    timed_out = runs.why_unfinished(result(timed_out=True, signal="SIGKILL", killed_by="timeout"), limits)
    assert timed_out == (
        "timed out after 16.8 s (the limit is 15 s: raise it with --test-timeout-s, or test_timeout_s in "
        "the project's manifest entry); no output"
    )
    crashed = runs.why_unfinished(result(exit_code=1, stderr="Traceback ...\nMemoryError\n"), limits)
    assert crashed == "exited with status 1 before pytest returned; output: 'Traceback ... MemoryError'"
    memory = runs.why_unfinished(result(signal="SIGKILL", limits_hit=("memory",)), limits)
    assert memory == "killed by SIGKILL; limits hit: memory; no output"


def test_a_project_time_limit_replaces_the_default() -> None:
    limits = LimitsConfig(timeout_s=120.0, cpu_s=121)
    assert runs.for_project(limits, SPEC) is limits
    own = runs.for_project(limits, SPEC.model_copy(update={"test_timeout_s": 300.0}))
    assert (own.timeout_s, own.cpu_s) == (300.0, 301)


# -- a user's manifest ----------------------------------------------------------------------------


def test_a_manifest_entry_may_name_a_local_sdist(tmp_path: Path) -> None:
    sdist = tmp_path / "dist" / "gadget-kit-1.0.tar.gz"
    sdist.parent.mkdir()
    sdist.write_bytes(b"not really a tarball")
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    manifest = tmp_path / "my.toml"
    entry = (
        '[[project]]\nname = "gadget-kit"\nversion = "1.0"\nlicence = "MIT"\npackages = ["gadgets"]\n'
        'tests = ["tests"]\nsdist = "dist/gadget-kit-1.0.tar.gz"\ntest_timeout_s = 30\n'
    )
    manifest.write_text(entry + f'sha256 = "{digest}"\n')
    (spec,) = load_manifest(manifest)
    assert spec.sdist == str(sdist) and spec.test_timeout_s == 30 and spec.kind == ""
    assert corpus.local_sdist(spec) == sdist
    with pytest.raises(corpus.ProjectError, match=f"has sha256 {digest}, the manifest says 00"):
        corpus.local_sdist(spec.model_copy(update={"sha256": "00" * 32}))
    manifest.write_text(entry)
    with pytest.raises(ValueError, match=r"my\.toml: project 'gadget-kit': an sdist needs its sha256"):
        load_manifest(manifest)


def test_the_command_lines_name_a_bad_manifest_and_a_bad_time_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from feature_deletion import cli

    bad = tmp_path / "mine.toml"
    bad.write_text('[[project]]\nname = "x"\n')
    for main in (cli.generate_main, cli.build_corpus_main):
        with pytest.raises(SystemExit) as exited:
            main(["--manifest", str(bad), "--store", str(tmp_path / "store")])
        assert exited.value.code == 2
        assert f"{bad}: not a valid project manifest" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.generate_main(["--corpus", "ci", "--manifest", str(bad)])
    assert "not allowed with argument" in capsys.readouterr().err
    good = tmp_path / "good.toml"
    good.write_text(
        '[[project]]\nname = "x"\nversion = "1"\nlicence = "MIT"\npackages = ["x"]\ntests = ["t"]\n'
    )
    with pytest.raises(SystemExit):
        cli.generate_main(["--manifest", str(good), "--test-timeout-s", "0", "--store", str(tmp_path / "s")])
    assert "--test-timeout-s / --probe-timeout-s" in capsys.readouterr().err

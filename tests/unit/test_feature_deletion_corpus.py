"""Corpus building without the network: manifests, sdist verification, licences, unpacking, trees."""

from __future__ import annotations

import hashlib
import io
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "environments/feature_deletion"))

from feature_deletion import corpus
from feature_deletion.spec import CI_MANIFEST, PYPI_MANIFEST, ProjectSpec, Store, load_manifest


def spec(**changes: object) -> ProjectSpec:
    fields: dict[str, object] = {
        "name": "demo-pkg",
        "version": "1.0",
        "licence": "MIT",
        "kind": "k",
        "packages": ["demo"],
        "tests": ["tests"],
    }
    return ProjectSpec.model_validate({**fields, **changes})


def test_shipped_manifests_parse_and_pin_every_sdist() -> None:
    pypi = load_manifest(PYPI_MANIFEST)
    assert len(pypi) >= 5 and len({p.kind for p in pypi}) == len(pypi)
    assert all(p.sha256 is not None and len(p.sha256) == 64 for p in pypi)
    assert {p.licence for p in pypi} <= set(corpus._LICENCE_FAMILIES)
    ci = load_manifest(CI_MANIFEST)
    assert {p.name for p in ci} == {"textkit", "ledger", "intervals"}
    assert all(p.sha256 is None for p in ci)


def test_manifest_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(
        '[[project]]\nname = "x"\nversion = "1"\nlicence = "MIT"\nkind = "k"\npackages = ["../up"]\ntests = ["t"]\n'
    )
    with pytest.raises(ValueError, match=r"(?s)bad\.toml.*relative path"):
        load_manifest(path)
    path.write_text('[[project]]\nname = "x"\nversion = "1"\n')
    with pytest.raises(ValueError, match=r"bad\.toml"):
        load_manifest(path)


def make_sdist(root: Path, files: dict[str, str], top: str = "demo_pkg-1.0") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for rel, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{rel}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_a_cached_sdist_is_used_only_when_its_sha256_matches(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    store.sdists.mkdir(parents=True)
    data = make_sdist(tmp_path, {"PKG-INFO": "Name: demo-pkg\n"})
    (store.sdists / "demo_pkg-1.0.tar.gz").write_bytes(data)
    good = spec(sha256=hashlib.sha256(data).hexdigest())
    assert corpus.fetch_sdist(good, store) == store.sdists / "demo_pkg-1.0.tar.gz"
    assert corpus._verified_sdist(spec(sha256="0" * 64), store) is None  # a tampered cache is ignored
    with pytest.raises(corpus.ProjectError, match="no sha256"):
        corpus.fetch_sdist(spec(), store)


def test_licence_must_match_the_sdist_metadata(tmp_path: Path) -> None:
    (tmp_path / "PKG-INFO").write_text(
        "Metadata-Version: 2.1\nName: demo\nLicense: BSD\nClassifier: License :: OSI Approved :: BSD License\n"
    )
    assert "BSD" in corpus.check_licence(spec(licence="BSD-3-Clause"), tmp_path)
    with pytest.raises(corpus.ProjectError, match="manifest says MIT"):
        corpus.check_licence(spec(licence="MIT"), tmp_path)
    with pytest.raises(corpus.ProjectError, match="not on the permissive list"):
        corpus.check_licence(spec(licence="GPL-3.0-only"), tmp_path)


def test_unpack_refuses_paths_outside_the_destination(tmp_path: Path) -> None:
    sdist = tmp_path / "evil.tar.gz"
    sdist.write_bytes(make_sdist(tmp_path, {"../../escape.py": "x"}, top="demo"))
    with pytest.raises(tarfile.OutsideDestinationError):
        corpus.unpack(sdist, tmp_path / "out")
    assert not (tmp_path / "escape.py").exists()


def test_the_tree_is_a_cleaned_whitelist(tmp_path: Path) -> None:
    root = tmp_path / "demo_pkg-1.0"
    files = {
        "demo/__init__.py": "x = 1\n",
        "demo/__pycache__/__init__.cpython-311.pyc": "bytecode",
        "demo/stale.pyc": "bytecode",
        "demo/.mypy_cache/3.11/demo.data.json": "{}",
        "tests/test_demo.py": "def test(): pass\n",
        "tests/.pytest_cache/v/lastfailed": "{}",
        "demo.egg-info/SOURCES.txt": "demo/__init__.py\n",
        "docs/index.rst": "x = 1\n",
        "CHANGELOG.md": "removed code here\n",
        "LICENSE": "MIT\n",
        "PKG-INFO": "Name: demo\n",
        ".git/HEAD": "ref\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    corpus.make_tree(spec(), root, tmp_path / "tree")
    kept = sorted(
        p.relative_to(tmp_path / "tree").as_posix() for p in (tmp_path / "tree").rglob("*") if p.is_file()
    )
    assert kept == ["LICENSE", "demo/__init__.py", "tests/test_demo.py"]


def test_native_code_and_links_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "p"
    (root / "demo").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "demo" / "fast.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    with pytest.raises(corpus.ProjectError, match="native code"):
        corpus.make_tree(spec(), root, tmp_path / "tree")
    (root / "demo" / "fast.cpython-311-x86_64-linux-gnu.so").unlink()
    (root / "demo" / "link.py").symlink_to("/etc/passwd")
    with pytest.raises(corpus.ProjectError, match="symlink"):
        corpus.make_tree(spec(), root, tmp_path / "tree2")


def test_baseline_outcomes_are_classified_by_what_every_run_agrees_on() -> None:
    runs = [
        {"a": "passed", "b": "failed", "c": "xpassed", "d": "xfailed", "e": "skipped", "f": "passed",
         "p[1]": "passed", "p[2]": "passed", "g": "error"},
        {"a": "passed", "b": "failed", "c": "xpassed", "d": "xfailed", "e": "skipped", "f": "failed",
         "p[1]": "passed", "p[3]": "passed", "g": "error"},
    ]  # fmt: skip
    passed, skipped, flaky, failing = corpus.classify(runs)
    assert passed == ["a"]
    # An xfail-marked test is never relied on, whether it failed as expected or passed anyway (a
    # non-strict xfail that passes, e.g. sqlparse's test_issue484_comments_and_newlines).
    assert skipped == ["c", "d", "e"]
    # f passed once; p[2] and p[3] were collected in one run each, so p[1] cannot be trusted either.
    assert sorted(flaky) == ["f", "p[1]", "p[2]", "p[3]"]
    assert failing == ["b", "g"]

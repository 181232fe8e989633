"""Building the corpus: fetch (PyPI sdists, pinned by sha256) or copy (CI projects), clean, test, record.

``build_project`` turns one ``ProjectSpec`` into ``<store>/projects/<slug>/``:

1. **Source.** A PyPI project's sdist is downloaded with pip (``--require-hashes``), its sha256
   checked again on read, its licence checked against the sdist's metadata, and it is unpacked
   with tarfile's ``data`` filter. A CI project is copied from ``corpus/ci/<name>/``.
2. **Tree.** Only the packages, the tests, ``extra_files`` and licence files are kept; every
   ``__pycache__``, ``*.pyc``, egg-info, dist-info and type-checker or linter cache is dropped.
   A tree holding compiled extensions or symlinks is refused (pure Python, plain files only).
3. **Visibility.** A search run *inside the sandbox* looks through everything sandboxed code can
   read for an installed or vendored copy of the project (its module files, dist-info/egg-info,
   sdists or wheels); a project found anywhere is refused, since an agent could read it.
4. **Baseline.** The suite runs twice in the sandbox; the project is kept when the tests that
   fail both times are at most ``1 - min_pass_rate`` of those that ran (none, by default).
   Tests that pass only once, or whose ids are not the same in both runs, are *flaky*; skipped
   ones are *skipped*; neither is ever used.
5. **Record.** One more run under the recorder (``sandboxed.Recorder``) writes, per test, the
   functions it ran and its plain-data calls into the project (``record.jsonl``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import stat
import subprocess
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Iterable
from email.parser import Parser
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from feature_deletion import runs, visibility
from feature_deletion.spec import CI_SOURCES, CorpusName, ProjectSpec, Store
from prime_composer.config.sandbox import LimitsConfig
from prime_composer.io import atomic_write_text
from prime_composer.sandbox import Sandbox

logger = logging.getLogger(__name__)

CACHE_DIRS = {
    "__pycache__",
    ".mypy_cache",
    ".pytype",
    ".pyre",
    ".ruff_cache",
    ".pytest_cache",
    ".hypothesis",
    ".tox",
    ".nox",
    ".git",
    ".hg",
    ".svn",
    ".eggs",
    "build",
    "dist",
}
"""Folders dropped from a tree wherever they are (bytecode, type-checker and linter caches, VCS)."""

DROPPED_SUFFIXES = (".pyc", ".pyo", ".egg-info", ".dist-info", ".orig", ".rej", ".swp")
NATIVE_SUFFIXES = (".so", ".pyd", ".dll", ".dylib", ".c", ".cpp", ".pyx", ".pxd")
LICENCE_PREFIXES = ("license", "licence", "copying")

RECORD_OPTIONS = {"max_nodes": 2000, "max_calls": 64, "max_call_chars": 16000}
"""Recorder bounds: values per encoded call, plain calls kept per test, JSON size per call."""

_LICENCE_FAMILIES = {
    "MIT": ("mit",),
    "BSD-2-Clause": ("bsd",),
    "BSD-3-Clause": ("bsd",),
    "Apache-2.0": ("apache",),
    "ISC": ("isc",),
    "PSF-2.0": ("python software foundation", "psf"),
}


class ProjectError(RuntimeError):
    """A project cannot be part of the corpus; the message says why."""


class Project(BaseModel):
    """A built project (``project.json``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    spec: ProjectSpec
    corpus: CorpusName
    licence_evidence: str
    """What the sdist's metadata says about the licence (``local`` for CI projects)."""
    num_tests: int
    passed: list[str]
    """Tests that passed in every baseline run: the only ones tasks use."""
    skipped: list[str]
    """Tests skipped or marked ``xfail`` in every run, e.g. for a missing optional dependency."""
    flaky: list[str]
    failing: list[str]
    """Tests that failed or errored in every run (never used)."""
    pass_rate: float
    """Share of the tests that ran (not skipped) that passed in every run (flaky ones count as not)."""
    suite_s: float
    """Wall time of one sandboxed baseline run."""
    record_s: float
    hidden_paths: list[str] = []
    """Folders hidden from sandboxed code when the project was built (and scanned): every sandbox
    its tasks run in hides them too, whatever its config says."""
    scanned: bool = False
    """The visibility scan ran (and found no copy) when the project was built."""

    def dir(self, store: Store) -> Path:
        return store.project(self.spec.slug)

    def tree(self, store: Store) -> Path:
        return self.dir(store) / "tree"

    def record_file(self, store: Store) -> Path:
        return self.dir(store) / "record.jsonl"


def load_project(store: Store, slug: str) -> Project:
    path = store.project(slug) / "project.json"
    try:
        return Project.model_validate_json(path.read_text())
    except (OSError, ValueError) as e:
        raise ProjectError(f"{path}: not a built project ({e}); build the corpus first") from e


def stored_hidden(projects: Iterable[Project]) -> list[Path]:
    """The folders the projects were built with hidden that still exist (in order, once each)."""
    paths = (Path(p) for project in projects for p in project.hidden_paths)
    return [p for p in dict.fromkeys(paths) if p.is_dir()]


# -- sources -------------------------------------------------------------------------------


def fetch_sdist(spec: ProjectSpec, store: Store) -> Path:
    """The verified sdist of a PyPI project, downloaded with pip on first use."""
    if spec.sha256 is None:
        raise ProjectError(f"{spec.name}: the manifest entry has no sha256")
    store.sdists.mkdir(parents=True, exist_ok=True)
    found = _verified_sdist(spec, store)
    if found is None:
        with tempfile.TemporaryDirectory(dir=store.root) as tmp:
            requirements = Path(tmp) / "requirements.txt"
            requirements.write_text(f"{spec.name}=={spec.version} --hash=sha256:{spec.sha256}\n")
            command = ["uvx", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
            command += ["--require-hashes", "-r", str(requirements), "-d", str(store.sdists)]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise ProjectError(f"{spec.name}: pip download failed: {result.stderr.strip()[-2000:]}")
        found = _verified_sdist(spec, store)
    if found is None:
        raise ProjectError(f"{spec.name}: no sdist with sha256 {spec.sha256} after downloading")
    return found


def local_sdist(spec: ProjectSpec) -> Path:
    """A manifest entry's own sdist file, checked against its sha256."""
    path = Path(spec.sdist or "")
    if not path.is_file():
        raise ProjectError(f"{spec.name}: the manifest's sdist {str(path)!r} is not a file")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != spec.sha256:
        raise ProjectError(
            f"{spec.name}: {path} has sha256 {digest}, the manifest says {spec.sha256}; fix the manifest's sha256"
        )
    return path


def _verified_sdist(spec: ProjectSpec, store: Store) -> Path | None:
    for path in sorted(store.sdists.iterdir()):
        if path.is_file() and _sdist_name(path.name) == _normalize(f"{spec.name}-{spec.version}"):
            if hashlib.sha256(path.read_bytes()).hexdigest() == spec.sha256:
                return path
            logger.warning("%s: sha256 mismatch, ignoring it", path)
    return None


def _sdist_name(filename: str) -> str:
    for suffix in (".tar.gz", ".zip", ".tgz"):
        if filename.endswith(suffix):
            return _normalize(filename[: -len(suffix)])
    return ""


def _normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def unpack(sdist: Path, dest: Path) -> Path:
    """Unpack an sdist into ``dest``; returns its single top folder."""
    if sdist.name.endswith(".zip"):
        with zipfile.ZipFile(sdist) as archive:
            for member in archive.namelist():
                if member.startswith("/") or ".." in Path(member).parts:
                    raise ProjectError(f"{sdist.name}: unsafe path {member!r} in the archive")
            archive.extractall(dest)
    else:
        with tarfile.open(sdist) as archive:
            archive.extractall(dest, filter="data")
    tops = [p for p in dest.iterdir() if p.is_dir()]
    if len(tops) != 1:
        raise ProjectError(f"{sdist.name}: expected one top folder, found {[p.name for p in tops]}")
    return tops[0]


def check_licence(spec: ProjectSpec, root: Path) -> str:
    """The licence evidence of an unpacked sdist; raises when it contradicts the manifest."""
    pkg_info = root / "PKG-INFO"
    if not pkg_info.is_file():
        raise ProjectError(f"{spec.name}: the sdist has no PKG-INFO")
    metadata = Parser().parsestr(pkg_info.read_text(errors="replace"))
    fields = [metadata.get("License-Expression"), metadata.get("License")]
    fields += [c for c in metadata.get_all("Classifier") or [] if c.startswith("License ::")]
    evidence = " | ".join(f.strip().splitlines()[0] for f in fields if f and f.strip())
    families = _LICENCE_FAMILIES.get(spec.licence)
    if families is None:
        raise ProjectError(f"{spec.name}: licence {spec.licence!r} is not on the permissive list")
    if not any(family in evidence.lower() for family in families) and spec.licence not in evidence:
        raise ProjectError(
            f"{spec.name}: the manifest says {spec.licence} but the metadata says {evidence!r}"
        )
    return evidence


# -- the tree ------------------------------------------------------------------------------


def make_tree(spec: ProjectSpec, root: Path, tree: Path) -> None:
    """Copy the whitelisted parts of an unpacked project into ``tree`` and clean them."""
    wanted = [*spec.package_paths, *spec.tests, *spec.extra_files]
    wanted += [p.name for p in root.iterdir() if p.is_file() and p.name.lower().startswith(LICENCE_PREFIXES)]
    for rel in dict.fromkeys(wanted):
        source = root / rel
        if not source.exists():
            raise ProjectError(f"{spec.name}: {rel!r} (from the manifest) is not in the project")
        target = tree / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
        else:
            shutil.copy2(source, target, follow_symlinks=False)
    clean_tree(spec, tree)


def clean_tree(spec: ProjectSpec, tree: Path) -> None:
    """Drop caches and build metadata; refuse native code and links."""
    for path in sorted(tree.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        name = path.name
        if (
            not path.is_symlink()
            and path.is_dir()
            and (name in CACHE_DIRS or name.endswith(DROPPED_SUFFIXES))
        ):
            shutil.rmtree(path)
        elif path.is_symlink():
            raise ProjectError(f"{spec.name}: {path.relative_to(tree)} is a symlink")
        elif path.is_file() and name.endswith(DROPPED_SUFFIXES):
            path.unlink()
        elif path.is_file() and name.endswith(NATIVE_SUFFIXES):
            raise ProjectError(f"{spec.name}: {path.relative_to(tree)} is native code (not pure Python)")
    for path in tree.rglob("*"):
        mode = path.lstat().st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise ProjectError(f"{spec.name}: {path.relative_to(tree)} is not a plain file")


# -- runs ------------------------------------------------------------------------------------


def scan_visible(sandbox: Sandbox, spec: ProjectSpec, tree: Path, limits: LimitsConfig) -> list[str]:
    """Paths, as sandboxed code sees the file system, that hold a copy of the project in any form:
    a module's source (two of its longest lines), its bytecode, a dist-info, egg-info, sdist,
    wheel or zip named after it, as a file or inside an archive (see ``visibility``)."""
    found = visibility.scan(sandbox, [fingerprint(spec, tree)], limits)
    return found[spec.slug]


def fingerprint(spec: ProjectSpec, tree: Path) -> dict[str, Any]:
    """What a copy of the project looks like (``visibility.fingerprint``)."""
    return visibility.fingerprint(spec, spec.slug, tree, _package_files(spec, tree))


def _package_files(spec: ProjectSpec, tree: Path) -> list[Path]:
    files: list[Path] = []
    tests = [tree / t for t in spec.tests]
    for rel in spec.package_paths:
        path = tree / rel
        found = [path] if path.is_file() else sorted(path.rglob("*.py"))
        files.extend(
            f for f in found if not any(f == t or t in f.parents for t in tests) and not _is_test_name(f.name)
        )
    return files


def _is_test_name(name: str) -> bool:
    return name == "conftest.py" or name.startswith("test_") or name.endswith("_test.py")


def package_files(spec: ProjectSpec, tree: Path) -> list[str]:
    """The project's non-test source files (``.py``), relative to the tree."""
    return [p.relative_to(tree).as_posix() for p in _package_files(spec, tree)]


def baseline(
    sandbox: Sandbox, spec: ProjectSpec, tree: Path, limits: LimitsConfig, num_runs: int = 2
) -> tuple[list[dict[str, str]], float]:
    """Outcomes of ``num_runs`` sandboxed runs of the suite, and the wall time of one."""
    results: list[dict[str, str]] = []
    durations: list[float] = []
    for _ in range(num_runs):
        with sandbox.workspace(tree) as ws:
            result, _ = runs.run_pytest(sandbox, ws, spec, limits)
        if not result.ended or result.collect_errors:
            raise ProjectError(
                f"{spec.name}: the test suite did not run to the end in the sandbox: "
                f"{runs.why_unfinished(result, limits)}"
            )
        results.append(result.outcomes)
        durations.append(result.run.duration_s)
    return results, min(durations)


def classify(outcomes: list[dict[str, str]]) -> tuple[list[str], list[str], list[str], list[str]]:
    """``(passed, skipped, flaky, failing)`` from the baseline runs' outcomes (test id -> outcome).

    *Passed* in every run: the only tests tasks use. *Skipped*: skipped or marked ``xfail`` in
    every run, whether the expected failure happened (``xfailed``) or not (``xpassed``, a
    non-strict xfail that passes): the project itself says not to rely on it. *Flaky*: passed in
    some runs only, collected in some runs only, or a case of a parametrized test whose ids change
    between runs. *Failing*: the rest (failed or errored)."""
    tests = sorted(set().union(*(o.keys() for o in outcomes)))
    passed = [t for t in tests if all(o.get(t) == "passed" for o in outcomes)]
    skipped = [t for t in tests if all(o.get(t) in ("skipped", "xfailed", "xpassed") for o in outcomes)]
    flaky = [
        t
        for t in tests
        if t not in passed
        and t not in skipped
        and (any(o.get(t) == "passed" for o in outcomes) or any(t not in o for o in outcomes))
    ]
    # A test function whose parametrized ids are unstable may give any of its ids to another case
    # next time: none of its ids can be relied on.
    unstable = {t.split("[", 1)[0] for t in flaky if "[" in t}
    flaky += [t for t in passed if t.split("[", 1)[0] in unstable]
    passed = [t for t in passed if t.split("[", 1)[0] not in unstable]
    failing = [t for t in tests if t not in passed and t not in skipped and t not in flaky]
    return passed, skipped, flaky, failing


def record(sandbox: Sandbox, spec: ProjectSpec, tree: Path, out: Path, limits: LimitsConfig) -> float:
    """Run the suite under the recorder; copy its output to ``out``; the wall time."""
    with sandbox.workspace(tree) as ws:
        start = time.monotonic()
        result, _ = runs.run_pytest(sandbox, ws, spec, limits, record=dict(RECORD_OPTIONS))
        elapsed = time.monotonic() - start
        if not result.ended:
            raise ProjectError(
                f"{spec.name}: the recorded run did not finish: {runs.why_unfinished(result, limits)}"
            )
        lines = list(runs.read_lines(ws.tmp / "record.jsonl"))
    atomic_write_text(out, "".join(json.dumps(line) + "\n" for line in lines))
    return elapsed


# -- one project -------------------------------------------------------------------------


def build_project(
    spec: ProjectSpec,
    corpus: CorpusName,
    store: Store,
    sandbox: Sandbox,
    *,
    limits: LimitsConfig,
    scan_limits: LimitsConfig | None = None,
    min_pass_rate: float = 1.0,
    source: Path | None = None,
) -> Project:
    """Build (or rebuild) one project into the store; raises ``ProjectError`` when it is refused.

    ``source`` is the project folder for a CI project (default ``corpus/ci/<name>``); PyPI
    projects are fetched. ``scan_limits=None`` skips the visibility scan.
    """
    store.ensure()
    limits = runs.for_project(limits, spec)
    out = store.project(spec.slug)
    with tempfile.TemporaryDirectory(dir=store.root) as tmp:
        staging = Path(tmp) / "project"
        tree = staging / "tree"
        if corpus in ("pypi", "user"):
            sdist = local_sdist(spec) if spec.sdist is not None else fetch_sdist(spec, store)
            root = unpack(sdist, Path(tmp) / "unpacked")
            evidence = check_licence(spec, root)
        else:
            root = source or CI_SOURCES / spec.name
            evidence = "local"
        make_tree(spec, root, tree)
        if scan_limits is not None:
            try:
                visible = scan_visible(sandbox, spec, tree, scan_limits)
            except visibility.VisibilityError as e:
                raise ProjectError(f"{spec.name}: {e}") from e
            if visible:
                raise ProjectError(
                    f"{spec.name}: sandboxed code can read a copy of the project at {visible[:5]}; hide "
                    "those folders (--hide, stored with the project) or drop the project"
                )
        outcomes, suite_s = baseline(sandbox, spec, tree, limits)
        tests = sorted(set().union(*(o.keys() for o in outcomes)))
        passed, skipped, flaky, failing = classify(outcomes)
        num_run = len(passed) + len(flaky) + len(failing)
        rate = len(passed) / num_run if num_run else 0.0
        if not passed or len(failing) > (1 - min_pass_rate) * num_run:
            raise ProjectError(
                f"{spec.name}: {len(failing)} of {num_run} tests that ran fail in the sandbox (allowed: "
                f"{1 - min_pass_rate:.0%}); e.g. {failing[:5]}"
            )
        record_s = record(sandbox, spec, tree, staging / "record.jsonl", limits)
        project = Project(
            spec=spec,
            corpus=corpus,
            licence_evidence=evidence,
            num_tests=len(tests),
            passed=passed,
            skipped=skipped,
            flaky=flaky,
            failing=failing,
            pass_rate=rate,
            suite_s=suite_s,
            record_s=record_s,
            hidden_paths=[str(p) for p in sandbox.config.hidden_paths],
            scanned=scan_limits is not None,
        )
        atomic_write_text(staging / "project.json", project.model_dump_json(indent=1))
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(out)
    return project


def corpus_summary(built: list[Project], refused: dict[str, str]) -> dict[str, Any]:
    """The corpus report: each kept project's licence, kind, size and pass rate; the refusals."""
    return {
        "projects": [
            {
                "name": p.spec.name,
                "version": p.spec.version,
                "licence": p.spec.licence,
                "kind": p.spec.kind,
                "num_tests": p.num_tests,
                "pass_rate": round(p.pass_rate, 4),
                "num_skipped": len(p.skipped),
                "num_flaky": len(p.flaky),
                "suite_s": round(p.suite_s, 2),
            }
            for p in built
        ],
        "refused": refused,
    }

"""What a source project is (``ProjectSpec``, one manifest entry) and where built things live (``Store``).

Two manifests ship with the environment, both TOML lists of ``[[project]]`` tables:

- ``corpus/pypi.toml``: permissively licensed, pure-Python projects fetched from PyPI as sdists,
  pinned by version and sha256 (``build_corpus.py`` fetches them; nothing fetched is committed);
- ``corpus/ci.toml``: small projects written for this repository (``corpus/ci/<name>/``), the
  corpus the tests use, since they must not need the network.

A project's *tree* is a whitelist of its sdist: the packages, the tests, the files named in
``extra_files`` and its licence files. Documentation, examples, changelogs and build metadata
are left out because they can hold the code a task deletes.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

ENV_DIR = Path(__file__).resolve().parents[1]
"""``environments/feature_deletion/``."""

CORPUS_DIR = ENV_DIR / "corpus"
PYPI_MANIFEST = CORPUS_DIR / "pypi.toml"
CI_MANIFEST = CORPUS_DIR / "ci.toml"
CI_SOURCES = CORPUS_DIR / "ci"

DEFAULT_STORE = Path("~/.cache/prime-composer/feature-deletion").expanduser()
"""Where sdists, the test Python, built projects and tasks go unless told otherwise; it must stay
invisible to sandboxed code (``/root`` and ``/home`` are hidden by the sandbox)."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class ProjectSpec(Strict):
    """One project of a manifest."""

    name: str
    """Distribution name on PyPI (or of the CI project)."""
    version: str
    """Pinned version."""
    sha256: str | None = None
    """SHA-256 of the sdist (PyPI projects); ``None`` for CI projects, which are not fetched."""
    licence: str
    """SPDX identifier; checked against the sdist's metadata when it is fetched."""
    sdist: str | None = None
    """A local sdist (``.tar.gz`` or ``.zip``) to build from instead of fetching from PyPI: a path,
    relative to the manifest's folder or absolute; its sha256 must be ``sha256``."""
    kind: str = ""
    """What sort of code it is (for the corpus report)."""
    source_root: str = "."
    """Folder (relative to the project root) that goes on ``sys.path``: ``.`` or ``src``."""
    packages: list[str] = Field(min_length=1)
    """Import packages (folders) or single modules (``name.py``), relative to ``source_root``."""
    tests: list[str] = Field(min_length=1)
    """Test folders or files, relative to the project root."""
    extra_files: list[str] = Field(default_factory=list)
    """Other files the tests need (e.g. ``conftest.py``, ``pytest.ini``), relative to the root."""
    pytest_args: list[str] = Field(default_factory=list)
    """Extra pytest arguments for every run (e.g. ``-p no:doctest``, ``--deselect ...``). The test
    command is ``python -m pytest <pytest_args> <tests>`` with ``source_root`` on ``sys.path``."""
    test_timeout_s: float | None = Field(default=None, gt=0)
    """Wall-clock limit of one run of this project's suite (build, validation, grading); default:
    the command line's ``--test-timeout-s`` (120 s)."""

    @field_validator("packages", "tests", "extra_files")
    @classmethod
    def _relative(cls, paths: list[str]) -> list[str]:
        for path in paths:
            if path.startswith("/") or ".." in Path(path).parts:
                raise ValueError(f"{path!r} must be a relative path inside the project")
        return paths

    @property
    def slug(self) -> str:
        return f"{self.name}-{self.version}"

    @property
    def import_names(self) -> list[str]:
        """Top-level module names of the project."""
        return [Path(p).name.removesuffix(".py") for p in self.packages]

    @property
    def package_paths(self) -> list[str]:
        """Package folders and module files relative to the project root."""
        root = Path(self.source_root)
        return [(root / p).as_posix() for p in self.packages]


class Manifest(Strict):
    project: list[ProjectSpec] = Field(min_length=1)


def load_manifest(path: Path) -> list[ProjectSpec]:
    """The projects of a manifest; errors name the file and the entry."""
    try:
        data = tomllib.loads(Path(path).read_text())
        projects = Manifest.model_validate(data).project
    except (OSError, tomllib.TOMLDecodeError, ValidationError) as e:
        raise ValueError(f"{path}: not a valid project manifest: {e}") from e
    folder = Path(path).resolve().parent
    projects = [
        p.model_copy(update={"sdist": str(folder / p.sdist)}) if p.sdist is not None else p for p in projects
    ]
    for p in projects:
        if p.sdist is not None and p.sha256 is None:
            raise ValueError(f"{path}: project {p.name!r}: an sdist needs its sha256 (sha256 = ...)")
    names = [p.name for p in projects]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: a project is listed twice: {names}")
    return projects


CorpusName = Literal["pypi", "ci", "canary", "user"]
"""``user``: a project of a manifest given with ``--manifest`` (a local sdist, or one on PyPI)."""


class Store:
    """The folders built things live in, under one root (``DEFAULT_STORE`` by default)::

        sdists/                 fetched sdists, verified by sha256
        projects/<slug>/        project.json, tree/ (cleaned sources + tests), record.jsonl
        tasks/<taskset>/        tasks.jsonl, attempts.jsonl and summary.json

    The Python environment sandboxed tests run with lives in ``python_root`` (default
    ``DEFAULT_STORE/python``), apart from the rest: it must not lie under ``/tmp`` (each sandboxed
    run gets its own ``/tmp``), which a store made by a test often does.
    """

    def __init__(self, root: Path | None = None, python_root: Path | None = None) -> None:
        self.root = Path(root or DEFAULT_STORE).expanduser().resolve()
        self.python_root = Path(python_root or DEFAULT_STORE / "python").expanduser().resolve()

    @property
    def sdists(self) -> Path:
        return self.root / "sdists"

    def python(self, tag: str) -> Path:
        return self.python_root / tag

    def project(self, slug: str) -> Path:
        return self.root / "projects" / slug

    def taskset(self, name: str) -> Path:
        return self.root / "tasks" / name

    def ensure(self) -> None:
        """Create the root, readable by this user only (sandboxed code runs as other users)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)

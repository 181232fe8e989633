"""Digests written with every file the processes hand each other or resume from, checked on read.

A file on disk can be truncated (a full disk, a killed copy), zeroed (a bad block) or replaced
(a stale directory); without a digest such a file loads and silently trains or serves the wrong
thing. So every writer records a SHA-256 (about 1.5 GB/s on one core with SHA-NI) next to the
data and every reader checks it before trusting a byte:

- a **directory** (a checkpoint part, a published weights version) gets ``MANIFEST.json``
  (relative path -> size and digest of every file under it), written after the files and before
  the directory's completeness marker (``STABLE``); ``verify_manifest`` checks every listed file;
- a **single file** embeds its digest in its own header (the rollout batches: see
  ``transport/batch.py``), using ``bytes_digest``.

A mismatch raises ``IntegrityError``, whose message names the file, what is wrong with it and
what to do. No torch import: every process uses this.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from prime_composer.config.errors import DamagedInputError
from prime_composer.io import atomic_write_text

ALGORITHM = "sha256"
MANIFEST_NAME = "MANIFEST.json"
_CHUNK = 1 << 20


class IntegrityError(DamagedInputError, ValueError):
    """A file does not match the digest written with it (or is missing from its directory)."""


def bytes_digest(*parts: bytes | memoryview) -> str:
    """Hex SHA-256 of the concatenation of ``parts``."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.hexdigest()


def file_digest(path: Path) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _listed_files(directory: Path, exclude: Iterable[str]) -> list[Path]:
    skip = {MANIFEST_NAME, *exclude}
    return sorted(
        p for p in directory.rglob("*") if p.is_file() and p.relative_to(directory).as_posix() not in skip
    )


def write_manifest(directory: Path, exclude: Iterable[str] = ()) -> Path:
    """Write ``<directory>/MANIFEST.json`` for every file under ``directory`` (recursively), except
    the relative paths in ``exclude``; returns its path. Call it after the last file is written and
    before the completeness marker."""
    directory = Path(directory)
    files = {p.relative_to(directory).as_posix(): file_entry(p) for p in _listed_files(directory, exclude)}
    return write_manifest_entries(directory, files)


def file_entry(path: Path) -> dict[str, int | str]:
    """The manifest entry of one file: its size and digest."""
    return {"bytes": path.stat().st_size, ALGORITHM: file_digest(path)}


def listed_files(directory: Path) -> list[str]:
    """The relative paths ``write_manifest`` would list for ``directory``."""
    return [p.relative_to(directory).as_posix() for p in _listed_files(Path(directory), ())]


def write_manifest_entries(directory: Path, files: dict[str, dict[str, int | str]]) -> Path:
    """Write ``<directory>/MANIFEST.json`` from entries already computed (``file_entry``, e.g. by
    the processes that wrote the files); returns its path."""
    path = Path(directory) / MANIFEST_NAME
    table = dict(sorted(files.items()))
    atomic_write_text(path, json.dumps({"algorithm": ALGORITHM, "files": table}, indent=1) + "\n")
    return path


def read_manifest(directory: Path) -> dict[str, dict[str, int | str]]:
    """The ``files`` table of ``<directory>/MANIFEST.json``; ``IntegrityError`` if absent or unreadable."""
    path = Path(directory) / MANIFEST_NAME
    try:
        data = json.loads(path.read_text())
        files = data["files"]
        if data.get("algorithm") != ALGORITHM or not isinstance(files, dict):
            raise ValueError(f"unknown manifest format (algorithm {data.get('algorithm')!r})")
    except FileNotFoundError:
        raise IntegrityError(
            f"{path}: missing, so the files of {directory} cannot be verified (written by an older version, "
            "or the write did not finish)"
        ) from None
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise IntegrityError(f"{path}: unreadable ({e}); the directory cannot be verified") from None
    return files


def verify_manifest(directory: Path, only: Iterable[str] | None = None) -> None:
    """Check every file listed in ``<directory>/MANIFEST.json`` (or just the relative paths in
    ``only``) against its size and digest; raise ``IntegrityError`` naming the first bad file."""
    directory = Path(directory)
    files = read_manifest(directory)
    names = sorted(files) if only is None else list(only)
    for name in names:
        entry = files.get(name)
        path = directory / name
        if entry is None:
            raise IntegrityError(f"{path}: not listed in {directory / MANIFEST_NAME}")
        if not path.is_file():
            raise IntegrityError(f"{path}: listed in {MANIFEST_NAME} but missing")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise IntegrityError(
                f"{path}: {size} bytes but {entry['bytes']} were written (truncated or overwritten)"
            )
        if file_digest(path) != entry[ALGORITHM]:
            raise IntegrityError(f"{path}: contents differ from the digest written with it (corrupted)")

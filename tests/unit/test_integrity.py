"""Manifests and digests catch truncation, zeroed bytes, bit flips and missing files."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from prime_composer.integrity import (
    MANIFEST_NAME,
    IntegrityError,
    bytes_digest,
    file_digest,
    verify_manifest,
    write_manifest,
)


def make_dir(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "a.bin").write_bytes(bytes(range(256)) * 4096)
    (root / "sub" / "b.json").write_text('{"x": 1}')
    return root


def test_digests_are_sha256(tmp_path: Path) -> None:
    data = b"prime-composer" * 1000
    (tmp_path / "f").write_bytes(data)
    assert file_digest(tmp_path / "f") == hashlib.sha256(data).hexdigest()
    assert bytes_digest(data[:5], memoryview(data)[5:]) == hashlib.sha256(data).hexdigest()


def test_a_clean_directory_verifies(tmp_path: Path) -> None:
    directory = make_dir(tmp_path / "d")
    write_manifest(directory)
    verify_manifest(directory)
    verify_manifest(directory, only=["sub/b.json"])


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: flip(d / "a.bin", 500_000), "corrupted"),
        (lambda d: (d / "a.bin").write_bytes((d / "a.bin").read_bytes()[:-10]), "truncated"),
        (lambda d: (d / "sub" / "b.json").unlink(), "missing"),
        (lambda d: (d / MANIFEST_NAME).unlink(), "cannot be verified"),
        (lambda d: (d / MANIFEST_NAME).write_text("{not json"), "unreadable"),
    ],
)
def test_damage_is_named(tmp_path: Path, damage, message: str) -> None:
    directory = make_dir(tmp_path / "d")
    write_manifest(directory)
    damage(directory)
    with pytest.raises(IntegrityError, match=message):
        verify_manifest(directory)


def test_zeroed_block_of_the_same_size_is_caught(tmp_path: Path) -> None:
    directory = make_dir(tmp_path / "d")
    write_manifest(directory)
    data = bytearray((directory / "a.bin").read_bytes())
    data[1000:60_000] = bytes(59_000)
    (directory / "a.bin").write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"a\.bin.*corrupted"):
        verify_manifest(directory)


def test_excluded_files_are_not_listed(tmp_path: Path) -> None:
    directory = make_dir(tmp_path / "d")
    write_manifest(directory, exclude=["sub/b.json"])
    (directory / "sub" / "b.json").write_text("changed later")
    verify_manifest(directory)
    with pytest.raises(IntegrityError, match="not listed"):
        verify_manifest(directory, only=["sub/b.json"])

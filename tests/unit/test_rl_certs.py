"""``rl certs``: a key (mode 0600) and a self-signed certificate for the hosts given, the printed
fingerprint being the SHA-256 of the certificate (checked with ``cryptography`` and ``hashlib``
independently); an existing key is kept unless ``--force``."""

from __future__ import annotations

import hashlib
import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from prime_composer.launch import rl


def _certs(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        rl.main(["certs", *argv])
    out = capsys.readouterr()
    return int(info.value.code or 0), out.out, out.err


def test_certs_writes_a_0600_key_and_prints_the_pin(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "tls"
    code, stdout, err = _certs(capsys, "--out", str(out), "--host", "127.0.0.1", "--host", "relay.example")
    assert code == 0, err
    fingerprint = stdout.splitlines()[0]
    cert = x509.load_pem_x509_certificate((out / "cert.pem").read_bytes())
    der = cert.public_bytes(serialization.Encoding.DER)
    assert fingerprint == "sha256:" + hashlib.sha256(der).hexdigest()
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in names.get_values_for_type(x509.IPAddress)
    assert "relay.example" in names.get_values_for_type(x509.DNSName)
    assert stat.S_IMODE((out / "key.pem").stat().st_mode) == 0o600
    key = serialization.load_pem_private_key((out / "key.pem").read_bytes(), None)
    assert key.public_key().public_numbers() == cert.public_key().public_numbers()  # type: ignore[union-attr]
    assert not [p.name for p in out.iterdir() if p.name not in ("cert.pem", "key.pem")]  # no temp files left
    key_pem = (out / "key.pem").read_text()
    assert key_pem not in stdout + err  # the key is never printed

    # Run again: the key and so the pin are kept; --force makes a new pair.
    code, again, _ = _certs(capsys, "--out", str(out), "--host", "127.0.0.1")
    assert code == 0 and again.splitlines()[0] == fingerprint and (out / "key.pem").read_text() == key_pem
    code, forced, _ = _certs(capsys, "--out", str(out), "--host", "127.0.0.1", "--force")
    assert code == 0 and forced.splitlines()[0] != fingerprint and (out / "key.pem").read_text() != key_pem


def test_certs_refuses_a_key_without_its_certificate(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "key.pem").write_text("an orphan key")
    code, _, err = _certs(capsys, "--out", str(tmp_path))
    assert code == 2 and "exists without" in err and "--force" in err
    assert (tmp_path / "key.pem").read_text() == "an orphan key"

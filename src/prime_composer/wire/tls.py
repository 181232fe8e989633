"""TLS between DCs: a self-signed certificate per origin, pinned by its SHA-256 fingerprint.

No certificate authority is involved: each DC generates its own certificate and key once::

    uv run python -m prime_composer.wire.tls --out ~/.diloco-tls --name dc-eu

which writes ``cert.pem`` and ``key.pem`` (mode 0600) and prints the fingerprint
(``sha256:<64 hex>``, the SHA-256 of the certificate's DER bytes). The DC serves HTTPS with
``diloco.tls_cert`` / ``diloco.tls_key``; every peer lists that fingerprint as
``peers[].fingerprint`` and refuses any other certificate, whatever its names or issuer (so a
stolen CA, a hostname trick or a proxy in the middle gets nothing). The client side checks the
pin right after the handshake, before a byte of the request is sent.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import ssl
import sys
from pathlib import Path

from prime_composer.config.diloco import normalize_fingerprint

__all__ = ["PinError", "check_pin", "generate", "normalize_fingerprint", "server_context"]


class PinError(ConnectionError):
    """The server's certificate is not the one pinned for it."""


def fingerprint_of_der(der: bytes) -> str:
    return f"sha256:{hashlib.sha256(der).hexdigest()}"


def fingerprint_of_pem(path: Path) -> str:
    """The fingerprint of the certificate in PEM file ``path``."""
    return fingerprint_of_der(ssl.PEM_cert_to_DER_cert(Path(path).read_text()))


def generate(out: Path, name: str = "diloco", days: int = 825, hosts: tuple[str, ...] = ()) -> str:
    """Write ``out/cert.pem`` and ``out/key.pem`` (an ECDSA P-256 self-signed certificate);
    returns its fingerprint. The key file is created 0600 and written atomically."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    sans: list[x509.GeneralName] = [x509.DNSName(name)]
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    tmp_key = out / ".key.pem.tmp"
    fd = os.open(tmp_key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_pem)
    os.replace(tmp_key, out / "key.pem")
    tmp_cert = out / ".cert.pem.tmp"
    tmp_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    os.replace(tmp_cert, out / "cert.pem")
    return fingerprint_of_der(cert.public_bytes(serialization.Encoding.DER))


def server_context(
    cert: Path, key: Path, keys: tuple[str, str] = ("diloco.tls_cert", "diloco.tls_key")
) -> ssl.SSLContext:
    """The origin's TLS context (TLS 1.2+); ``ValueError`` naming the files (as the config
    ``keys`` that gave them) if they do not load."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as e:
        raise ValueError(
            f"{keys[0]} = {str(cert)!r} / {keys[1]} = {str(key)!r} do not load ({e}); "
            "generate them with `python -m prime_composer.wire.tls --out DIR`"
        ) from None
    return ctx


def client_context() -> ssl.SSLContext:
    """A client context that accepts any certificate in the handshake: the pin is checked by the
    caller on the DER bytes right after it (``check_pin``), before anything is sent."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def pin_mismatch(der: bytes | None, expected: str) -> str | None:
    """What the peer presented (its fingerprint, or "no certificate") when it is not ``expected``;
    None when the pin holds."""
    got = fingerprint_of_der(der) if der else "no certificate"
    return None if got == expected else got


def check_pin(sock: ssl.SSLSocket, expected: str, where: str) -> None:
    """``PinError`` unless the peer's certificate has fingerprint ``expected``."""
    got = pin_mismatch(sock.getpeercert(binary_form=True), expected)
    if got is not None:
        raise PinError(
            f"{where} presented certificate {got}, but {expected} is pinned for it in peers[].fingerprint: "
            "refusing to talk to it (a wrong pin, a regenerated certificate, or someone in the middle)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m prime_composer.wire.tls",
        description="Generate the self-signed certificate a DC's DiLoCo origin serves, and print "
        "the fingerprint its peers pin (peers[].fingerprint).",
    )
    parser.add_argument("--out", type=Path, required=True, help="directory for cert.pem and key.pem")
    parser.add_argument(
        "--name", default="diloco", help="the certificate's common name (e.g. the cluster id)"
    )
    parser.add_argument("--host", action="append", default=[], help="an address or name to list (repeatable)")
    parser.add_argument("--days", type=int, default=825, help="validity in days")
    parser.add_argument("--force", action="store_true", help="overwrite an existing key")
    args = parser.parse_args(argv)
    if (args.out / "key.pem").exists() and not args.force:
        print(
            f"{args.out / 'key.pem'} exists: pass --force to replace it (peers must re-pin)", file=sys.stderr
        )
        return 2
    fingerprint = generate(args.out, args.name, args.days, tuple(args.host))
    print(f"wrote {args.out / 'cert.pem'} and {args.out / 'key.pem'}")
    print(f"fingerprint = {fingerprint!r}   # peers list this as peers[].fingerprint")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``rl certs --out DIR --host ADDRESS``: a key and a self-signed certificate for one server of the
run, and the fingerprint its clients pin.

Any server that crosses machines takes it: an inference server (``inference.tls_cert`` /
``tls_key``; clients pin ``orchestrator.inference_tls_fingerprint``), a DiLoCo origin
(``diloco.tls_cert`` / ``tls_key``; peers pin ``peers[].fingerprint``), a relay (``rl relay``'s
``tls_cert`` / ``tls_key``; pinned as ``...@sha256:<fingerprint>``). The certificate lists every
``--host`` (an IP address or a name) so CA-style clients accept it too; pinned clients check the
fingerprint only. ``DIR/key.pem`` is created mode 0600 and both files are written atomically
(``wire/tls.generate``); an existing key is kept unless ``--force`` (a new key changes the
fingerprint every client pins). The first line printed is the fingerprint alone, for scripts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from prime_composer.wire.tls import fingerprint_of_pem, generate

    parser = argparse.ArgumentParser(
        prog="rl certs",
        description="Make a TLS key and self-signed certificate; print the fingerprint to pin.",
    )
    parser.add_argument("--out", type=Path, required=True, help="directory for cert.pem and key.pem (0600)")
    parser.add_argument(
        "--host",
        action="append",
        default=[],
        help="an address or DNS name clients reach the server by (repeatable)",
    )
    parser.add_argument("--name", default="prime-composer", help="the certificate's common name")
    parser.add_argument("--days", type=int, default=825, help="validity in days (default 825)")
    parser.add_argument("--force", action="store_true", help="replace an existing key (a new fingerprint)")
    args = parser.parse_args(argv)
    if args.days < 1:
        print(f"rl certs: --days {args.days}: give a positive number of days", file=sys.stderr)
        return 2
    cert, key = args.out / "cert.pem", args.out / "key.pem"
    if key.exists() and not args.force:
        if not cert.is_file():
            print(f"rl certs: {key} exists without {cert}: pass --force to make a new pair", file=sys.stderr)
            return 2
        print(fingerprint_of_pem(cert))
        print(
            f"kept the existing {key} (pass --force for a new key, and re-pin every client)", file=sys.stderr
        )
        return 0
    try:
        fingerprint = generate(args.out, args.name, days=args.days, hosts=tuple(args.host))
    except OSError as e:
        print(f"rl certs: cannot write under {args.out}: {e}", file=sys.stderr)
        return 1
    print(fingerprint)
    print(
        f'  serve with:  tls_cert = "{cert}"  tls_key = "{key}"  (inference., diloco., or rl relay)\n'
        f'  clients pin: orchestrator.inference_tls_fingerprint = "{fingerprint}", diloco.peers[].fingerprint,\n'
        f"               or a URL's @{fingerprint}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``rl relay @ relay.toml``: one relay process of the run, from a config file like any other.

Two kinds (``kind``):

- ``weights``: a ``transport.remote.WeightsRelay`` near the inference workers of another data
  center. It fetches each step once from ``upstream`` (the trainer side's weights origin, or with
  ``upstream_is_relay`` another weights relay: chains origin -> relay -> relay -> worker), checks
  it before keeping it and serves it to the workers, who list it in ``inference.weights_relays``.
  Its key comes from ``python -m prime_composer.transport.remote relay-key --secret-env S``. The
  older ``python -m prime_composer.transport.remote relay --flags`` runs this command with
  ``--kind weights`` (its ``--root`` is ``--dir``, its ``--upstream-relay`` ``--upstream-is-relay``).
- ``diloco``: a ``diloco.relay.RelayServer`` every DC reaches, for DCs with no inbound port
  (``diloco.relay``). Its key comes from ``python -m prime_composer.diloco.relay key --secret-env S``.
  With ``upstream`` (``host:port@sha256:<fingerprint>``, as a DC's ``diloco.relay``) it sits behind
  another DiLoCo relay: DCs -> relay -> relay <- DCs (``diloco/relay.py``). The older
  ``python -m prime_composer.diloco.relay serve --flags`` runs this command with ``--kind diloco``.

Either way the relay holds a key derived from the run's secret (``key_env`` names the variable
holding its hex; never in the config, the logs or ``--dry-run``'s output), binds 127.0.0.1 unless
``host`` says otherwise, takes a free port unless ``port`` is set, and serves HTTPS with
``tls_cert`` / ``tls_key`` (``rl certs``): off loopback plain HTTP needs ``private_network = true``.
Once listening it prints one line: ``relay ready on HOST:PORT`` and the value to give its
clients (``https://HOST:PORT@sha256:<fp>`` for workers, ``HOST:PORT@sha256:<fp>`` for DCs).
SIGTERM or SIGINT stops it.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Literal, Self
from urllib.parse import urlsplit

from pydantic import Field, model_validator

from prime_composer.config.base import BaseConfig
from prime_composer.config.errors import ConfigError
from prime_composer.netaddr import is_loopback, peer_url_problem

_HEX_KEY = re.compile(r"[0-9a-f]{64}")


class RelayConfig(BaseConfig):
    """A relay process (``rl relay``): a weights relay near remote inference workers, or a
    DiLoCo relay for DCs behind NAT."""

    kind: Literal["weights", "diloco"] = "weights"
    """``weights``: relay published steps to inference workers; ``diloco``: relay the DCs' payloads."""

    key_env: str
    """Name of the environment variable holding the relay key (64 hex digits, derived from the
    run's secret: ``transport.remote relay-key`` for ``weights``, ``diloco.relay key`` for ``diloco``)."""

    dir: Path
    """Where the relay keeps what it relays (a cache of steps; the DiLoCo blobs, emptied at start)."""

    host: str = "127.0.0.1"
    """Address to bind; off loopback it needs ``tls_cert`` or ``private_network``."""

    port: int = Field(default=0, ge=0, le=65535)
    """TCP port; 0: a free one, printed once listening."""

    tls_cert: Path | None = None
    """PEM certificate to serve HTTPS with (``rl certs --out DIR --host <address>``), with ``tls_key``."""

    tls_key: Path | None = None
    """PEM private key of ``tls_cert``."""

    private_network: bool = False
    """The links to this relay (and to its upstream) are already private: plain HTTP off loopback allowed."""

    auth_window_s: float = Field(default=120.0, gt=0, le=3600)
    """Replay window of signed requests (keep clocks in sync to well within it)."""

    # --- kind = "weights" ---
    upstream: str | None = None
    """``weights``: where steps come from, ``https://host:port@sha256:<fingerprint>`` (the weights
    origin, or another relay with ``upstream_is_relay``); ``http://host:port`` on loopback or a
    private network only. ``diloco``: the DiLoCo relay this one sits behind (a chain; optional),
    ``host:port@sha256:<fingerprint>`` like a DC's ``diloco.relay``."""

    upstream_is_relay: bool = False
    """``weights``: ``upstream`` is another weights relay (a chain), not the origin."""

    keep_steps: int = Field(default=3, ge=1)
    """``weights``: newest steps kept in the cache."""

    timeout_s: float = Field(default=300.0, gt=0)
    """``weights``: time limit for fetching one step from upstream."""

    # --- kind = "diloco" ---
    max_blob_bytes: int = Field(default=1 << 30, ge=1)
    """``diloco``: largest payload accepted."""

    max_total_bytes: int = Field(default=16 << 30, ge=1)
    """``diloco``: bytes kept in all."""

    max_clusters: int = Field(default=64, ge=1)
    """``diloco``: DCs the relay serves."""

    keep_rounds: int = Field(default=8, ge=1)
    """``diloco``: rounds kept."""

    upstream_timeout_s: float = Field(default=30.0, gt=0)
    """``diloco`` with ``upstream``: time limit of each call to the upstream relay (a listing, a
    blob, one try of forwarding a blob; a blob is retried for this long)."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("relay.tls_cert and relay.tls_key go together: set both or neither")
        if self.tls_cert is None and not is_loopback(self.host) and not self.private_network:
            raise ValueError(
                f"relay host = {self.host!r} serves other machines over plain HTTP: set tls_cert and "
                "tls_key (`rl certs --out DIR --host <address>`), or private_network = true if every "
                "link to the relay is already private"
            )
        if self.kind == "diloco":
            if self.upstream_is_relay:
                raise ValueError(
                    "relay upstream_is_relay: a diloco relay's upstream is always a relay; leave it out"
                )
            if self.upstream is not None:
                from prime_composer.config.diloco import parse_relay

                try:
                    url, _ = parse_relay(self.upstream)
                except ValueError as e:
                    raise ValueError(str(e).replace("diloco.relay", "relay upstream")) from None
                if (
                    url.startswith("http://")
                    and not is_loopback(urlsplit(url).hostname or "")
                    and not self.private_network
                ):
                    raise ValueError(
                        f"relay upstream = {self.upstream!r} is plain HTTP off loopback: use "
                        "'host:port@sha256:<fingerprint>', or private_network = true if the link is private"
                    )
            return self
        if self.upstream is None:
            raise ValueError(
                "relay upstream: a weights relay needs the origin it relays, "
                "upstream = 'https://host:port@sha256:<fingerprint>'"
            )
        problem = peer_url_problem(
            self.upstream, private_network=self.private_network, flag="private_network", pin_word="its"
        )
        if problem:
            raise ValueError(f"relay upstream = {self.upstream!r}: {problem}")
        return self


def _key(config: RelayConfig) -> bytes:
    raw = os.environ.get(config.key_env, "")
    if not _HEX_KEY.fullmatch(raw):
        tool = "transport.remote relay-key" if config.kind == "weights" else "diloco.relay key"
        raise ConfigError(
            f"relay key_env = {config.key_env!r}: that variable must hold the 64 hex digits "
            f"`python -m prime_composer.{tool} --secret-env <the run's secret variable>` prints"
        )
    return bytes.fromhex(raw)


def check(config: RelayConfig) -> None:
    """What ``--dry-run`` checks without listening: the key variable and the TLS files."""
    _key(config)
    _tls(config)
    if config.upstream is not None and config.kind == "weights":
        from prime_composer.transport.remote import url_and_pin

        try:
            url_and_pin(config.upstream)
        except ValueError as e:
            raise ConfigError(f"relay upstream = {config.upstream!r}: {e}") from None


def _tls(config: RelayConfig):  # type: ignore[no-untyped-def]
    if config.tls_cert is None or config.tls_key is None:
        return None
    from prime_composer.wire.tls import server_context

    try:
        return server_context(config.tls_cert, config.tls_key, keys=("relay tls_cert", "relay tls_key"))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def run(config: RelayConfig) -> int:
    from prime_composer.logs import setup_logging

    check(config)
    setup_logging("relay")
    key, tls = _key(config), _tls(config)
    stop = threading.Event()  # set before the ready line: a SIGTERM right after it stops cleanly
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server: object
    try:
        if config.kind == "weights":
            from prime_composer.transport.remote import WeightsRelay, url_and_pin

            assert config.upstream is not None
            upstream, pin = url_and_pin(config.upstream)
            server = WeightsRelay(
                config.dir,
                config.host,
                config.port,
                key,
                upstream,
                pin,
                tls=tls,
                window_s=config.auth_window_s,
                timeout_s=config.timeout_s,
                keep_steps=config.keep_steps,
                upstream_is_relay=config.upstream_is_relay,
            )
        else:
            from prime_composer.config.diloco import parse_relay
            from prime_composer.diloco.relay import RelayServer

            server = RelayServer(
                config.host,
                config.port,
                key,
                config.dir,
                tls=tls,
                max_blob_bytes=config.max_blob_bytes,
                max_total_bytes=config.max_total_bytes,
                max_clusters=config.max_clusters,
                keep_rounds=config.keep_rounds,
                window_s=config.auth_window_s,
                upstream=None if config.upstream is None else parse_relay(config.upstream),
                upstream_timeout_s=config.upstream_timeout_s,
            )
    except OSError as e:
        raise ConfigError(f"relay: cannot listen on {config.host}:{config.port}: {e}") from None
    port = server.port  # type: ignore[attr-defined]
    where = f"[{config.host}]:{port}" if ":" in config.host else f"{config.host}:{port}"
    if config.tls_cert is not None:
        from prime_composer.wire.tls import fingerprint_of_pem

        pin = fingerprint_of_pem(config.tls_cert)
        clients = f"https://{where}@{pin}" if config.kind == "weights" else f"{where}@{pin}"
    else:
        clients = f"http://{where}"
    key_name = "inference.weights_relays" if config.kind == "weights" else "diloco.relay"
    print(f"relay ready on {where}; clients set {key_name} = {clients!r}", flush=True)
    stop.wait()
    server.close()  # type: ignore[attr-defined]
    return 0


def main(argv: list[str] | None = None) -> int:
    from prime_composer.config.cli import run_entry_point

    return run_entry_point(
        RelayConfig,
        run,
        prog="rl relay",
        env_prefix="PRIME_COMPOSER_RELAY__",
        argv=list(sys.argv[1:] if argv is None else argv),
        describe="Run a weights relay (near remote inference workers) or a DiLoCo relay (for DCs behind NAT).",
        check=check,
    )


if __name__ == "__main__":
    raise SystemExit(main())

"""Inference workers on other machines: ``rl`` serves them the published weights.

With ``[transport.weights_origin] enabled = true`` (and ``launch.remote_inference = true``), ``rl`` starts no
inference server. Before the RL stage it serves ``<output_dir>/broadcasts`` with a
``transport/remote.WeightsOrigin`` in a thread of its own process (bound on the configured port,
or a free one), then:

- writes ``configs/inference-worker.json``: the run's inference section with
  ``weights_origin = "https://<host>:<port>@sha256:<fingerprint>"`` (the port it bound, the pin of
  its certificate) and ``weights_secret_env``; and ``configs/weights-origin.json`` (url, pin,
  the workers' commands) for scripts;
- prints, for each server of ``orchestrator.base_url``, the command that starts it on its own
  machine from a copy of that file::

      uv run inference @ inference-worker.json --host 10.0.0.7 --port 8000

- waits until every worker answers ``/health`` (``launch.health_timeout_s``) before the
  orchestrator starts, and closes the origin when the run ends.

Workers listed as ``https://`` in ``orchestrator.base_url`` serve the orchestrator over TLS. When
the run names no certificate for them (``inference.tls_cert``) and no way to trust one
(``orchestrator.inference_tls_fingerprint`` / ``inference_tls_ca``), ``rl`` makes one before it
writes the resolved configs (``prepare_worker_tls``): ``<output_dir>/inference-worker-tls/``
(``cert.pem`` listing every worker's host, ``key.pem`` 0600; kept, like the origin's, so a resumed
run keeps its pin), pins its fingerprint in the orchestrator's config, names
``inference-worker-tls/cert.pem`` / ``key.pem`` (relative: beside the worker's copy of its
config) in ``inference-worker.json``, records the fingerprint in ``weights-origin.json`` and says
to copy that folder with the config. The key is made on the trainer's machine: copy it over a
private channel (``scp``), or make one on each worker with ``rl certs`` and set the two keys
yourself (then ``rl`` makes nothing). The start-up wait checks a worker's ``/health`` against that
certificate (a CA: against the CA; a fingerprint alone: unchecked, as the route carries nothing,
while every later request of the orchestrator is pinned).

Each worker fetches the step the orchestrator names in ``/update_weights`` from the origin,
verifies it and loads it (``inference/weight_updates.py``, ``transport/remote.py``). Off loopback
the origin serves HTTPS: with ``tls_cert``/``tls_key`` given, or with a certificate ``rl`` makes
under ``<output_dir>/weights-origin/`` on the first run and keeps (so a resumed run keeps its
pin). The workers start from ``model.name`` on their own machine, so the SFT warm-up (whose result
lives on the trainer's disk) is refused with a remote origin.
"""

from __future__ import annotations

import json
import os
import shlex
import ssl
import time
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from prime_composer.config.errors import ConfigError, RunError
from prime_composer.config.inference import InferenceConfig
from prime_composer.config.transport import WeightsOriginConfig
from prime_composer.health import wait_healthy
from prime_composer.io import atomic_write_text
from prime_composer.netaddr import is_loopback, server_root

if TYPE_CHECKING:
    from prime_composer.config.rl import RLConfig
    from prime_composer.transport.remote import WeightsOrigin

WORKER_CONFIG = "inference-worker.json"
ORIGIN_RECORD = "weights-origin.json"
TLS_DIR = "weights-origin"
WORKER_TLS_DIR = "inference-worker-tls"
"""Under ``output_dir``: the certificate ``rl`` makes for ``https://`` workers; the worker config
names it relative to the worker's working directory (copy the folder beside the config)."""
WORKER_OUTPUT_DIR = Path("outputs/inference-worker")
"""The worker config's ``output_dir``: relative, on the worker's machine (its fetched steps)."""


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _tls(config: RLConfig, section: WeightsOriginConfig) -> tuple[Path, Path] | None:
    """The certificate and key to serve (made under ``<output_dir>/weights-origin/`` when none is
    given off loopback), or None for plain HTTP on loopback."""
    if section.tls_cert is not None and section.tls_key is not None:
        return section.tls_cert, section.tls_key
    if section.plain_http:
        return None
    from prime_composer.wire.tls import generate

    directory = config.output_dir / TLS_DIR
    cert, key = directory / "cert.pem", directory / "key.pem"
    if not (cert.is_file() and key.is_file()):
        generate(directory, "weights-origin", hosts=(section.url_host,))
    return cert, key


def _tls_workers(config: RLConfig) -> list[str]:
    """Host names of the ``https://`` servers of ``orchestrator.base_url`` off loopback."""
    hosts = []
    for url in config.orchestrator.server_urls:
        parts = urlsplit(url)
        if parts.scheme == "https" and not is_loopback(parts.hostname or ""):
            hosts.append(parts.hostname or "")
    return hosts


def prepare_worker_tls(config: RLConfig) -> str | None:
    """Make the ``https://`` workers' certificate and pin it in the orchestrator's config (see the
    module docstring); its fingerprint, or None when the run needs none or names its own."""
    if not (config.transport.weights_origin.enabled and config.launch.remote_inference):
        return None
    orchestrator = config.orchestrator
    hosts = _tls_workers(config)
    if not hosts or config.inference.tls_cert is not None:
        return None
    if orchestrator.inference_tls_fingerprint is not None or orchestrator.inference_tls_ca is not None:
        return None
    from prime_composer.wire.tls import fingerprint_of_pem, generate

    directory = config.output_dir / WORKER_TLS_DIR
    cert = directory / "cert.pem"
    if cert.is_file() and (directory / "key.pem").is_file():
        fingerprint = fingerprint_of_pem(cert)
    else:
        fingerprint = generate(directory, "inference-worker", hosts=tuple(dict.fromkeys(hosts)))
    orchestrator.inference_tls_fingerprint = fingerprint
    return fingerprint


def worker_config(config: RLConfig, weights_origin: str) -> InferenceConfig:
    """The inference section a worker runs: the run's, fetching its weights from ``weights_origin``,
    on the host and port of the first server of ``orchestrator.base_url``."""
    section = config.transport.weights_origin
    first = urlsplit(config.orchestrator.server_urls[0])
    if not is_loopback(first.hostname or "") and config.inference.secret_env is None:
        raise ConfigError(
            f"transport.weights_origin: the remote workers of orchestrator.base_url serve other machines "
            f"({first.hostname}): set inference.secret_env to the name of the variable holding their secret"
        )
    values = {
        **config.inference.model_dump(),
        "host": first.hostname,
        "port": first.port or 80,
        "output_dir": WORKER_OUTPUT_DIR,
        "weights_origin": weights_origin,
        "weights_secret_env": section.secret_env,
        "weights_relays": section.relays,
        "num_replicas": 1,
    }
    if (config.output_dir / WORKER_TLS_DIR / "cert.pem").is_file() and config.inference.tls_cert is None:
        values |= {"tls_cert": Path(WORKER_TLS_DIR, "cert.pem"), "tls_key": Path(WORKER_TLS_DIR, "key.pem")}
    try:
        return InferenceConfig.model_validate(values)
    except ValueError as e:
        raise ConfigError(
            f"transport.weights_origin: the remote workers' inference config is invalid: {e}"
        ) from None


def worker_commands(config: RLConfig, worker_config_file: str = WORKER_CONFIG) -> list[str]:
    """The command that starts each server of ``orchestrator.base_url`` on its machine."""
    commands = []
    for url in config.orchestrator.server_urls:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port or 80
        commands.append(f"uv run inference @ {shlex.quote(worker_config_file)} --host {host} --port {port}")
    return commands


def check(config: RLConfig) -> None:
    """Refuse what cannot work with remote workers, before anything starts."""
    section = config.transport.weights_origin
    if not section.enabled:
        return
    if config.warmup.enabled:
        raise ConfigError(
            "transport.weights_origin with warmup.enabled: remote workers start from model.name on their "
            "own machine, not from the warm-up's result on this one; turn the warm-up off (train it "
            "first and set model.name to a model the workers have too)"
        )
    from prime_composer.config.processes import node_processes

    if "inference" in {p.name for p in node_processes(config)}:
        raise ConfigError(
            "transport.weights_origin: this run starts its own inference server; set "
            "launch.remote_inference = true and list the workers in orchestrator.base_url"
        )
    if not os.environ.get(section.secret_env):
        raise ConfigError(
            f"transport.weights_origin.secret_env = {section.secret_env!r}: that environment variable is "
            "unset or empty; export the secret shared with the workers"
        )


def start_weights_origin(config: RLConfig) -> WeightsOrigin | None:
    """Serve the run's published steps to its remote workers (see the module docstring) and wait
    for the workers; None unless ``transport.weights_origin.enabled``. Close it when the run ends."""
    section = config.transport.weights_origin
    if not section.enabled:
        return None
    check(config)
    from prime_composer.transport.remote import WeightsOrigin
    from prime_composer.wire.tls import fingerprint_of_pem, server_context

    tls = _tls(config, section)
    try:
        context = None if tls is None else server_context(*tls)
    except ValueError as e:
        raise ConfigError(f"transport.weights_origin: {e}") from None
    secret = os.environ[section.secret_env].encode()
    broadcasts = config.output_dir / "broadcasts"
    try:
        origin = WeightsOrigin(broadcasts, section.host, section.port, secret, tls=context)
    except OSError as e:
        raise RunError(
            f"transport.weights_origin: cannot listen on {section.host}:{section.port}: {e}"
        ) from None
    try:
        url = f"{'http' if tls is None else 'https'}://{_url_host(section.url_host)}:{origin.port}"
        pin = None if tls is None else fingerprint_of_pem(tls[0])
        spec = url if pin is None else f"{url}@{pin}"
        configs = config.output_dir / "configs"
        worker = worker_config(config, spec)
        atomic_write_text(
            configs / WORKER_CONFIG, json.dumps(worker.model_dump(mode="json"), indent=2) + "\n"
        )
        commands = worker_commands(config)
        worker_pin = config.orchestrator.inference_tls_fingerprint
        record = {
            "url": url,
            "fingerprint": pin,
            "weights_origin": spec,
            "workers": commands,
            "inference_tls_fingerprint": worker_pin,
        }
        atomic_write_text(configs / ORIGIN_RECORD, json.dumps(record, indent=2) + "\n")
        secrets = " and ".join(
            f"${name}" for name in (section.secret_env, config.inference.secret_env) if name
        )
        copies = f"a copy of {configs / WORKER_CONFIG}"
        if worker.tls_cert is not None and not worker.tls_cert.is_absolute():
            copies += (
                f" and of {config.output_dir / WORKER_TLS_DIR}/ beside it (the workers' certificate, "
                f"pinned as {worker_pin}; its key.pem over a private channel)"
            )
        print(
            f"rl: serving {broadcasts} to remote inference workers at {spec}. Start each worker on its "
            f"machine from {copies}, with {secrets} exported as here:",
            flush=True,
        )
        for command in commands:
            print(f"rl:   {command}", flush=True)
        wait_for_workers(config)
    except BaseException:
        origin.close()
        raise
    return origin


def wait_for_workers(config: RLConfig) -> None:
    """Return once every server of ``orchestrator.base_url`` answers ``/health``; ``RunError``
    naming the first that does not within ``launch.health_timeout_s``."""
    deadline = time.monotonic() + config.launch.health_timeout_s
    context = _health_context(config)
    for url, command in zip(config.orchestrator.server_urls, worker_commands(config), strict=True):
        health = server_root(url) + "/health"
        waited = wait_healthy(health, max(0.0, deadline - time.monotonic()), poll_s=0.5, context=context)
        if not waited.healthy:
            raise RunError(
                f"the remote inference worker {url} did not answer {health} within "
                f"{config.launch.health_timeout_s:.0f} s (launch.health_timeout_s); start it with: {command}"
            )
        print(f"rl: remote inference worker {url} is up", flush=True)


def _health_context(config: RLConfig) -> ssl.SSLContext | None:
    """How the start-up wait checks an ``https://`` worker (see the module docstring)."""
    made = config.output_dir / WORKER_TLS_DIR / "cert.pem"
    cert = config.inference.tls_cert or (made if made.is_file() else None)
    if config.orchestrator.inference_tls_ca is not None:
        from prime_composer.client.tls import ca_context

        return ca_context(config.orchestrator.inference_tls_ca)
    if cert is not None and cert.is_file():  # the workers' own certificate: trusted as is
        context = ssl.create_default_context(cafile=str(cert))
        context.check_hostname = False
        return context
    if config.orchestrator.inference_tls_fingerprint is not None:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # /health only; the orchestrator pins every request
        return context
    return None

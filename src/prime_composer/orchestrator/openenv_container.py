"""OpenEnv servers from container images: ``openenv.image`` run with docker or podman for the run.

``serve_image`` (once per process and image) picks a free port of 127.0.0.1 and runs::

    docker run --rm -d -p 127.0.0.1:PORT:CONTAINER_PORT IMAGE

(``podman`` takes the same argv), keeps the container id the CLI prints, polls
``http://127.0.0.1:PORT/health`` until it answers 200 (``openenv.startup_timeout_s``), and stops
the container with ``docker stop ID`` when this process ends: at exit, and, should the process
be killed, from a small watcher process (its own session, so a signal to the orchestrator's group
does not end it first) that stops the container once this process's end closes its stdin. A
container that does not come up is an error with the end of ``docker logs ID``; ``--rm`` removes
a stopped container.

``runtime_problems`` is the ``rl`` preflight's check (also at ``--dry-run``): an image entry whose
runtime is not on ``PATH`` is named there, before anything starts. It imports only the stdlib,
the config and ``prime_composer.health`` (stdlib only) at import, as the preflight imports it.
"""

from __future__ import annotations

import atexit
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence

from prime_composer.config.env import EnvConfig, OpenEnvConfig
from prime_composer.health import wait_healthy

RUNTIMES = ("docker", "podman")
"""The container CLIs ``container_runtime = "auto"`` looks for, in this order."""

_WATCHER = r"""
import subprocess, sys
sys.stdin.buffer.read()  # returns when the orchestrator is gone (its end of the pipe closed)
subprocess.run([sys.argv[1], "stop", sys.argv[2]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
"""


def find_runtime(source: OpenEnvConfig) -> str | None:
    """The path of the container CLI for ``source`` (``None`` when it is not on ``PATH``)."""
    names = RUNTIMES if source.container_runtime == "auto" else (source.container_runtime,)
    return next((path for name in names if (path := shutil.which(name)) is not None), None)


def runtime_problems(entries: Sequence[EnvConfig]) -> list[str]:
    """One line per ``openenv.image`` entry whose container runtime is missing here."""
    return [
        _missing_runtime(entry.openenv, f"orchestrator.env[{i}]")
        for i, entry in enumerate(entries)
        if entry.openenv is not None
        and entry.openenv.image is not None
        and find_runtime(entry.openenv) is None
    ]


def _missing_runtime(source: OpenEnvConfig, where: str) -> str:
    wanted = " or ".join(RUNTIMES) if source.container_runtime == "auto" else source.container_runtime
    return (
        f"{where}: openenv.image = {source.image!r}: no container runtime to run it ({wanted} is not on "
        "PATH); install one, set openenv.container_runtime, or serve the environment yourself and give "
        "openenv.url"
    )


def run_argv(runtime: str, image: str, port: int, container_port: int) -> list[str]:
    """The argv that starts ``image`` detached, its server on ``127.0.0.1:port``."""
    return [runtime, "run", "--rm", "-d", "-p", f"127.0.0.1:{port}:{container_port}", image]


_served: dict[tuple[str, int], str] = {}
_stops: list[Callable[[], None]] = []


def stop_all() -> None:
    """Stop every container this process started (at exit; tests call it to see the end)."""
    while _stops:
        _stops.pop()()
    _served.clear()


def serve_image(source: OpenEnvConfig, where: str = "openenv") -> str:
    """Run ``source.image`` on a free port of 127.0.0.1 until this process ends; its URL."""
    from prime_composer.config.ports import free_port

    assert source.image is not None
    key = (source.image, source.container_port)
    if key in _served:
        return _served[key]
    runtime = find_runtime(source)
    if runtime is None:
        raise ValueError(_missing_runtime(source, where))
    port = free_port("127.0.0.1")
    argv = run_argv(runtime, source.image, port, source.container_port)
    try:
        started = subprocess.run(argv, capture_output=True, text=True, timeout=source.startup_timeout_s)
    except subprocess.TimeoutExpired:
        raise ValueError(
            f"{where}: `{' '.join(argv)}` did not return within {source.startup_timeout_s:g} s "
            "(openenv.startup_timeout_s; pulling a large image can take longer: pull it first)"
        ) from None
    if started.returncode != 0:
        raise ValueError(
            f"{where}: `{' '.join(argv)}` failed with exit code {started.returncode}: "
            f"{started.stderr.strip()[-2000:]}"
        )
    container = started.stdout.strip().splitlines()[-1] if started.stdout.strip() else ""
    if not container:
        raise ValueError(f"{where}: `{' '.join(argv)}` printed no container id")
    stop = _stopper(runtime, container)
    _stops.append(stop)
    url = f"http://127.0.0.1:{port}"
    waited = wait_healthy(
        f"{url}/health",
        source.startup_timeout_s,
        poll_s=0.2,
        give_up=lambda: None if _running(runtime, container) else "the container exited",
    )
    if not waited.healthy:
        logs = subprocess.run(
            [runtime, "logs", container], capture_output=True, text=True, timeout=30, check=False
        )
        stop()
        raise ValueError(
            f"{where}: the OpenEnv image {source.image!r} (container {container[:12]}) did not answer "
            f"/health within {source.startup_timeout_s:g} s (openenv.startup_timeout_s); its log ends:\n"
            f"{(logs.stdout + logs.stderr)[-2000:]}"
        )
    _served[key] = url
    return url


def _running(runtime: str, container: str) -> bool:
    """Whether the container still runs (``inspect`` fails once ``--rm`` removed it)."""
    inspected = subprocess.run(
        [runtime, "inspect", "--format", "{{.State.Running}}", container],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return inspected.returncode == 0 and inspected.stdout.strip() == "true"


def _stopper(runtime: str, container: str) -> Callable[[], None]:
    """The function that stops ``container`` (idempotent; ``stop_all`` calls it at exit), and a
    watcher process that stops it if this process is killed first."""
    watcher = subprocess.Popen(
        [sys.executable, "-c", _WATCHER, runtime, container],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    done = False

    def stop() -> None:
        nonlocal done
        if done:
            return
        done = True
        watcher.kill()  # stopped here: the watcher has nothing left to do
        watcher.wait()
        if watcher.stdin is not None:
            watcher.stdin.close()
        subprocess.run([runtime, "stop", container], capture_output=True, timeout=60, check=False)

    return stop


atexit.register(stop_all)

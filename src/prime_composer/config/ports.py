"""Ports of the servers ``rl`` starts: a free one unless the config sets one.

The inference server (``inference.port``), the teacher service (``teacher.port``) and the zmq
batch server (``transport.port``, with ``transport.kind = "zmq"``) each get a port nothing listens
on at resolve time, unless the user's config sets it (then it is used as given, and the preflight
says so when it is taken). The chosen ports are in the resolved configs ``rl`` writes
(``<output_dir>/configs/``), and the orchestrator's ``base_url`` and the replay channel's
``teacher_url`` follow them, so another program holding 8000 or 8100 does not stop a run.

Standalone processes (``uv run inference ...``) keep their documented defaults.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

from pydantic import BaseModel

from prime_composer.config.processes import SECTION_NAMES

if TYPE_CHECKING:
    from prime_composer.config.rl import RLConfig


def free_port(host: str = "127.0.0.1", taken: set[int] | None = None) -> int:
    """A port nothing listens on at ``host`` now and not in ``taken`` (which it joins). The one
    free-port helper of the project: a server binds it moments later, and one that loses it to
    another program fails its start with an error that says so."""
    taken = set() if taken is None else taken
    bind_host = "127.0.0.1" if host in ("", "localhost") else host.strip("[]")
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    for _ in range(100):
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((bind_host, 0))
            port = int(sock.getsockname()[1])
        if port not in taken:
            taken.add(port)
            return port
    raise RuntimeError("no free port found in 100 tries")  # pragma: no cover - the OS ran out


def _given(section: BaseModel, field: str = "port") -> bool:
    return field in section.model_fields_set


def assign_free_ports(config: RLConfig) -> None:
    """Give every server of the run that has no port in the config a free one (in place)."""
    servers: list[BaseModel] = [config.inference]
    if config.teacher is not None:
        servers.append(config.teacher)
    if config.transport.kind == "zmq":
        servers.append(config.transport)
    # An orchestrator.base_url given by the user names the inference port it expects.
    pinned = {id(config.inference)} if "base_url" in config.orchestrator.model_fields_set else set()
    taken = {int(s.port) for s in servers if _given(s) or id(s) in pinned}  # type: ignore[attr-defined]
    for server in servers:
        if not _given(server) and id(server) not in pinned:
            server.port = free_port(server.host, taken)  # type: ignore[attr-defined]
    if config.transport.kind == "zmq":  # a shared key: every section's copy follows
        for name in SECTION_NAMES:
            transport = getattr(getattr(config, name), "transport", None)
            if transport is not None and transport.port != config.transport.port:
                transport.port = config.transport.port

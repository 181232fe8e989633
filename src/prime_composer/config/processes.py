"""The processes of a run, in one place: what ``rl`` starts, which config section each reads, which
checkpoint parts each writes.

Everything that needs the list reads it from here: the launcher (start order, resolved configs,
health checks, torchrun), shared keys (the sections they are copied into), the warm-up (which
sections follow its model) and resume (which parts a complete checkpoint has). A new process (the teacher service, say) is one more ``Process`` in ``PROCESSES`` plus
its config section in ``RLConfig``; a new checkpoint part of an existing process (DiLoCo's outer
state in the trainer) is one more entry in ``CHECKPOINT_PARTS``.

No torch import: ``config/`` stays importable everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal


def _always(_: Any) -> bool:
    return True


@dataclass(frozen=True)
class Process:
    """One process of a run."""

    name: str
    """Its section of ``RLConfig``, its resolved config ``configs/<name>.json``, its log
    ``logs/<name>.log`` and its metrics ``metrics/<name>.jsonl``."""
    module: str
    """Run as ``python -m <module> @ configs/<name>.json``."""
    kind: Literal["service", "job"]
    """A ``job`` must exit 0 for the run to succeed; a ``service`` runs until the jobs are done."""
    health_path: str | None = None
    """HTTP path that answers 200 once the service is ready (the next process starts after it)."""
    enabled: Callable[[Any], bool] = _always
    """Whether the run has this process, given the root ``RLConfig``."""
    num_ranks: Callable[[Any], int] | None = None
    """Ranks to start under torchrun (more than 1), given the root ``RLConfig``."""
    waits_for: tuple[str, ...] | None = None
    """The services that must be healthy before it starts (``ProcessSpec.waits_for``): ``None``
    every earlier one, ``()`` none (the trainer calls no server: it starts with the first)."""
    starts_early: bool = False
    """Started with the first process and held at its start gate until the services are healthy
    (``ProcessSpec.starts_early``): the orchestrator loads its environments and tokenizer while
    the inference server loads the model."""


PROCESSES: tuple[Process, ...] = (
    Process(name="inference", module="prime_composer.inference.main", kind="service", health_path="/health"),
    Process(
        name="teacher",
        module="prime_composer.teacher.main",
        kind="service",
        health_path="/health",
        enabled=lambda rl: rl.teacher is not None,
    ),
    Process(name="orchestrator", module="prime_composer.orchestrator.main", kind="job", starts_early=True),
    Process(
        name="trainer",
        module="prime_composer.trainer.main",
        kind="job",
        num_ranks=lambda rl: rl.trainer.num_ranks,
        waits_for=(),
    ),
)
"""Every process a run can have, in start order (consumers after the services they call; the
consumers' setup overlaps the services' start: ``waits_for``, ``starts_early``)."""

SECTION_NAMES: tuple[str, ...] = tuple(p.name for p in PROCESSES)
"""The ``RLConfig`` sections that belong to a process (and receive the shared keys)."""


@dataclass(frozen=True)
class CheckpointPart:
    """One part of every checkpoint step: ``checkpoints/step_<N>/<name>/`` + ``<name>.STABLE``."""

    name: str
    writer: str
    """The process that writes it."""
    enabled: Callable[[Any], bool] = _always
    """Whether the run writes this part, given the root ``RLConfig``."""


CHECKPOINT_PARTS: tuple[CheckpointPart, ...] = (
    CheckpointPart(name="trainer", writer="trainer"),
    CheckpointPart(name="orchestrator", writer="orchestrator"),
    CheckpointPart(name="diloco", writer="trainer", enabled=lambda rl: rl.diloco.enabled),
)
"""Every part a checkpoint can have; a step is resumable when all of the run's parts are complete."""


def enabled_processes(rl: Any) -> list[Process]:
    """The processes of the run ``rl`` (an ``RLConfig``), in start order."""
    return [p for p in PROCESSES if p.enabled(rl)]


def node_processes(rl: Any) -> list[Process]:
    """The processes ``rl`` starts on this node, in start order: ``launch.processes`` when given,
    else every process of the run on node 0 (but inference with ``launch.remote_inference``) and
    the trainer alone on the others."""
    names = rl.launch.processes
    if names is None and rl.launch.node_rank > 0:
        names = ["trainer"]
    if names is None and rl.launch.remote_inference:
        names = [p.name for p in PROCESSES if p.name != "inference"]
    return [p for p in enabled_processes(rl) if names is None or p.name in names]


def ranks_per_node(rl: Any) -> int:
    """Trainer ranks each node starts: ``trainer.num_ranks / launch.nodes`` (the resolver checks
    that it divides)."""
    return int(rl.trainer.num_ranks // rl.launch.nodes)


def checkpoint_parts(rl: Any) -> tuple[str, ...]:
    """The part names every complete checkpoint of the run ``rl`` has."""
    names = {p.name for p in enabled_processes(rl)}
    return tuple(part.name for part in CHECKPOINT_PARTS if part.writer in names and part.enabled(rl))

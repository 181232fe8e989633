"""The contracts of the DiLoCo outer loop: ``OuterLoop`` (what the trainer calls), ``Store`` (where
the shardcast loop's payloads go), and their registries, keyed by ``diloco.backend`` and
``diloco.store``.

The trainer sees only ``OuterLoop``::

    outer = build_outer_loop(cfg.diloco, model, optimizer, output_dir / "diloco")
    for step in ...:
        ...optimizer.step() (or skip a non-finite update)...
        if outer.after_inner_step(step, num_tokens, skipped=not finite):
            publish(step + 1)            # an outer step moved the weights
        metrics |= outer.last_metrics
    outer.save(checkpoints, step)         # the ``diloco`` part of checkpoint ``step``
    outer.load(checkpoints, step)         # after the model's weights are restored
    outer.close()

A backend is a class registered under its ``diloco.backend`` literal with
``@register_outer_loop("name")``; its constructor takes ``(cfg, model, optimizer, work_dir)`` and
mypy checks that the instances it builds are ``OuterLoop``s. ``shardcast`` (``loop.py``) exchanges
signed, quantized payloads through a ``Store``; ``torchft`` (``torchft_backend.py``) runs
``torchft.local_sgd.DiLoCo``. The checkpoint part both write is ``part.py``'s.

A store is registered the same way, by its ``diloco.store`` literal, as a factory
``(cfg, work_dir, secret) -> Store`` (``@register_store("shardcast")`` in ``shardcast_store.py``);
the shardcast loop builds its store with ``build_store`` and never names a concrete class::

    store = build_store(cfg, work_dir, secret)    # diloco.store = "shardcast": a ShardcastStore
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

import torch
from torch import nn

from prime_composer.config.diloco import DilocoBackend, DilocoConfig, DilocoStoreName
from prime_composer.diloco.payload import Kind
from prime_composer.registry import Registry


class OuterLoop(Protocol):
    """The outer loop the trainer runs after its optimizer steps, whatever the backend."""

    @property
    def last_metrics(self) -> dict[str, float]:
        """Metrics of the newest round this DC applied (``diloco/round``, ``diloco/num_members``,
        ...); empty before the first. The trainer logs them with every step."""
        ...

    def after_inner_step(self, step: int, num_tokens: int, skipped: bool) -> bool:
        """Account for inner step ``step`` (``num_tokens`` trained on, over all ranks; ``skipped``:
        the optimizer did not step). True when the local weights changed (an outer step)."""
        ...

    def save(self, root: Path, step: int) -> Path:
        """Write the ``diloco`` part of checkpoint ``step`` under ``root`` (atomic, with its
        manifest and ``diloco.STABLE`` marker); returns its directory."""
        ...

    def load(self, root: Path, step: int) -> None:
        """Restore the ``diloco`` part of checkpoint ``step`` (verified), after the model's weights."""
        ...

    def finish(self) -> None:
        """End of the run, after the last checkpoint and before ``final/`` is exported: leave the
        model holding the weights it should be exported with."""
        ...

    def global_digest(self) -> str:
        """SHA-256 over the global weights of every fragment: equal in every DC after a round."""
        ...

    def close(self) -> None:
        """Finish what is in flight and release ports and threads."""
        ...


class Store(Protocol):
    """Where this DC publishes its payloads and fetches its peers' (``diloco.store``; ``shardcast``:
    ``ShardcastStore``, an origin this DC serves plus its peers' origins and relays).

    A payload is identified by its sender's cluster id, its ``Kind`` and its round; it is bytes the
    exchange has signed and verifies (``payload.py``), so a store only moves them. Every call is
    bounded by the ``timeout_s`` it is given and answers ``None`` instead of raising when a peer is
    unreachable: a slow or dead peer is data for the round's deadline, not an exception."""

    def publish(self, kind: Kind, round_: int, data: bytes) -> None:
        """Serve ``data`` as this DC's ``kind`` payload of ``round_`` (older rounds may be dropped)."""
        ...

    def available(self, cluster: str, timeout_s: float) -> set[tuple[str, int]] | None:
        """The ``(kind, round)`` payloads peer ``cluster`` serves now; ``None`` if it does not answer."""
        ...

    def fetch(
        self, cluster: str, kind: Kind, round_: int, timeout_s: float, max_bytes: int | None = None
    ) -> bytes | None:
        """Peer ``cluster``'s ``kind`` payload of ``round_``; ``None`` if it is not there (yet), or
        (where the store can tell before downloading it all) larger than ``max_bytes``."""
        ...

    def linger(self, owed: dict[str, list[tuple[Kind, int]]], timeout_s: float) -> list[str]:
        """Keep serving until each peer in ``owed`` has the listed payloads of this DC (or is gone),
        at most ``timeout_s``; returns the peers still waited for then. Called before ``close``
        at the end of a run, so that a peer is not left without the last commit."""
        ...

    def close(self) -> None:
        """Stop serving."""
        ...


OuterLoopFactory = Callable[[DilocoConfig, nn.Module, torch.optim.Optimizer, Path], OuterLoop]
"""An outer loop's constructor: ``(cfg, model, inner optimizer, work dir)``."""

OUTER_LOOPS: Registry[OuterLoopFactory] = Registry(
    "diloco.backend",
    {"shardcast": "prime_composer.diloco.loop", "torchft": "prime_composer.diloco.torchft_backend"},
)
"""The registered backends by ``diloco.backend`` literal, each imported on first use (torchft
only when it is chosen)."""

_Factory = TypeVar("_Factory", bound=OuterLoopFactory)


def register_outer_loop(name: DilocoBackend) -> Callable[[_Factory], _Factory]:
    """Register a backend's class under its ``diloco.backend`` literal (mypy checks that it
    constructs an ``OuterLoop`` from ``(cfg, model, optimizer, work_dir)``)."""

    def register(factory: _Factory) -> _Factory:
        OUTER_LOOPS.register(name, factory)
        return factory

    return register


def outer_loop_class(name: DilocoBackend) -> OuterLoopFactory:
    """The registered constructor of backend ``name`` (its module is imported here)."""
    return OUTER_LOOPS.get_or_load(name)


def build_outer_loop(
    cfg: DilocoConfig, model: nn.Module, optimizer: torch.optim.Optimizer, work_dir: Path
) -> OuterLoop:
    """The outer loop of ``cfg.backend``."""
    return outer_loop_class(cfg.backend)(cfg, model, optimizer, work_dir)


StoreFactory = Callable[[DilocoConfig, Path, bytes | None], Store]
"""A store's constructor: ``(cfg, work dir, the run's secret or None)``; it starts serving."""

STORES: Registry[StoreFactory] = Registry(
    "diloco.store", {"shardcast": "prime_composer.diloco.shardcast_store"}
)
"""The registered stores by ``diloco.store`` literal, each imported on first use."""

_StoreFactory = TypeVar("_StoreFactory", bound=StoreFactory)


def register_store(name: DilocoStoreName) -> Callable[[_StoreFactory], _StoreFactory]:
    """Register a store's factory under its ``diloco.store`` literal (mypy checks that it builds a
    ``Store`` from ``(cfg, work_dir, secret)``)."""

    def register(factory: _StoreFactory) -> _StoreFactory:
        STORES.register(name, factory)
        return factory

    return register


def build_store(cfg: DilocoConfig, work_dir: Path, secret: bytes | None) -> Store:
    """The store of ``cfg.store`` for this DC (its module is imported here)."""
    return STORES.get_or_load(cfg.store_name)(cfg, work_dir, secret)

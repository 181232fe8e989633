"""Pick the batch sender/receiver that ``transport.kind`` names."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from prime_composer.config.transport import TransportConfig
from prime_composer.transport.batch import MicroBatch


class BatchSender(Protocol):
    def send(self, step: int, rank_batches: list[list[MicroBatch]]) -> None: ...
    def close(self) -> None: ...


class BatchReceiver(Protocol):
    def receive(self, step: int, rank: int) -> list[MicroBatch]: ...
    def close(self) -> None: ...


def make_sender(cfg: TransportConfig, output_dir: Path) -> BatchSender:
    """The orchestrator's side of the transport."""
    if cfg.kind == "filesystem":
        from prime_composer.transport.filesystem import FilesystemSender

        return FilesystemSender(output_dir, cfg)
    from prime_composer.transport.zmq import ZmqSender

    return ZmqSender(cfg)


def make_receiver(cfg: TransportConfig, output_dir: Path) -> BatchReceiver:
    """A trainer rank's side of the transport."""
    if cfg.kind == "filesystem":
        from prime_composer.transport.filesystem import FilesystemReceiver

        return FilesystemReceiver(output_dir, cfg)
    from prime_composer.transport.zmq import ZmqReceiver

    return ZmqReceiver(cfg)

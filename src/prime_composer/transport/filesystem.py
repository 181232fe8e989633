"""Batch transport through a shared directory: ``<output_dir>/rollouts/step_<N>/rank_<R>.bin``.

The sender writes each file under a temporary name in the same directory and renames it into
place (``os.replace`` is atomic on POSIX), so a receiver that sees ``rank_R.bin`` sees all of
it. The sender deletes all but the newest ``keep_last_steps`` step directories. Easy to debug
(the files are plain safetensors) and to resume (the step is in the path). Each file carries a
digest of its contents (``batch.py``): a damaged file is refused, naming the file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from prime_composer.config.transport import TransportConfig
from prime_composer.integrity import IntegrityError
from prime_composer.transport.batch import BatchFormatError, MicroBatch, decode_rank_batch, encode_rank_batch


def step_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / "rollouts" / f"step_{step}"


def rank_path(output_dir: Path, step: int, rank: int) -> Path:
    return step_dir(output_dir, step) / f"rank_{rank}.bin"


class FilesystemSender:
    """Orchestrator side: writes one file per rank and step."""

    def __init__(self, output_dir: Path, cfg: TransportConfig) -> None:
        self.output_dir = Path(output_dir)
        self.cfg = cfg

    def send(self, step: int, rank_batches: list[list[MicroBatch]]) -> None:
        directory = step_dir(self.output_dir, step)
        directory.mkdir(parents=True, exist_ok=True)
        for rank, micro_batches in enumerate(rank_batches):
            _write_atomic(
                rank_path(self.output_dir, step, rank), encode_rank_batch(step, rank, micro_batches)
            )
        self._delete_old_steps(step)

    def _delete_old_steps(self, newest: int) -> None:
        for path in (self.output_dir / "rollouts").glob("step_*"):
            suffix = path.name.removeprefix("step_")
            if suffix.isdigit() and int(suffix) <= newest - self.cfg.keep_last_steps:
                shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        """Nothing to release: the files are the transport (same interface as zmq)."""


class FilesystemReceiver:
    """Trainer side: waits for a step's file to appear, then reads it."""

    def __init__(self, output_dir: Path, cfg: TransportConfig) -> None:
        self.output_dir = Path(output_dir)
        self.cfg = cfg

    def receive(self, step: int, rank: int) -> list[MicroBatch]:
        path = rank_path(self.output_dir, step, rank)
        deadline = time.monotonic() + self.cfg.receive_timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no batch for step {step} rank {rank}: {path} did not appear within "
                    f"transport.receive_timeout_s = {self.cfg.receive_timeout_s} s; is the orchestrator "
                    "running with transport.kind = 'filesystem' and the same output_dir?"
                )
            time.sleep(self.cfg.poll_interval_s)
        redo = (
            "nothing was trained on it. Resume the run (--resume) so the orchestrator writes this step again"
        )
        try:
            got_step, got_rank, micro_batches = decode_rank_batch(path.read_bytes())
        except (IntegrityError, BatchFormatError) as e:
            raise type(e)(f"{path}: {e}; {redo}") from None
        except OSError as e:  # a directory, or a file that cannot be read, in the batch's place
            raise IntegrityError(f"{path}: cannot be read as a batch ({e.strerror or e}); {redo}") from None
        if (got_step, got_rank) != (step, rank):
            raise BatchFormatError(
                f"{path}: holds step {got_step} rank {got_rank}, not step {step} rank {rank} (a file "
                f"of another run or step copied here?); {redo}"
            )
        return micro_batches

    def close(self) -> None:
        """Nothing to release: the files are the transport (same interface as zmq)."""


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the rename must not become visible before the data is on disk
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

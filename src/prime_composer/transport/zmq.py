"""Batch transport over zmq: the orchestrator serves batches, trainer ranks ask for them.

The orchestrator binds a ROUTER socket at ``tcp://host:port`` and keeps the encoded batches of
its newest ``keep_last_steps`` steps in memory; ``send`` only stores them. Each trainer rank
connects a DEALER socket and asks for ``(step, rank)``; a background thread of the sender
answers as soon as that step is stored. Asking by step means it does not matter whether the
orchestrator is behind (the request waits) or already ahead (step N is still there when N+1
has been sent), nor which side starts first.

With ``secret_env`` set, every message carries an HMAC-SHA256 over its frames and messages
without a valid one are rejected (integrity only: the data itself is not encrypted).

Frames: request ``[json {"step", "rank"}, mac]``; reply ``[json {"step", "rank"} or
{"error"}, payload, mac]`` where payload is ``encode_rank_batch`` bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import threading
import time

import zmq

from prime_composer.config.transport import TransportConfig
from prime_composer.transport.batch import MicroBatch, decode_rank_batch, encode_rank_batch

logger = logging.getLogger(__name__)


def _read_secret(cfg: TransportConfig) -> bytes | None:
    if cfg.secret_env is None:
        return None
    secret = os.environ.get(cfg.secret_env)
    if not secret:
        raise ValueError(
            f"transport.secret_env = {cfg.secret_env!r} but that environment variable is not set "
            "(or empty) in this process: export it for both orchestrator and trainer"
        )
    return secret.encode()


def _mac(secret: bytes | None, frames: list[bytes]) -> bytes:
    if secret is None:
        return b""
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for frame in frames:  # length-prefixed so frame boundaries are part of what is signed
        h.update(len(frame).to_bytes(8, "little"))
        h.update(frame)
    return h.digest()


def _verified(secret: bytes | None, frames: list[bytes]) -> list[bytes] | None:
    """The frames without their mac if the mac is valid, else None."""
    *body, mac = frames
    return body if hmac.compare_digest(mac, _mac(secret, body)) else None


def _parse_request(secret: bytes | None, frames: list[bytes]) -> tuple[int, int] | None:
    """``(step, rank)`` of a valid request, None for anything else (never raises)."""
    body = _verified(secret, frames) if len(frames) == 2 else None
    try:
        request = json.loads(body[0]) if body is not None else None
        return (int(request["step"]), int(request["rank"])) if request is not None else None
    except (ValueError, KeyError, TypeError):
        return None


class ZmqSender:
    """Orchestrator side: stores each step's batches and serves them to the ranks that ask."""

    def __init__(self, cfg: TransportConfig) -> None:
        self.cfg = cfg
        self._secret = _read_secret(cfg)
        self._steps: dict[int, list[bytes]] = {}
        self._newest_step = -1
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(f"tcp://{cfg.host}:{cfg.port}")  # here, so a busy port fails in the caller
        self._thread = threading.Thread(target=self._serve, name="zmq-batch-server", daemon=True)
        self._thread.start()

    def send(self, step: int, rank_batches: list[list[MicroBatch]]) -> None:
        encoded = [encode_rank_batch(step, rank, mbs) for rank, mbs in enumerate(rank_batches)]
        with self._lock:
            self._steps[step] = encoded
            self._newest_step = max(self._newest_step, step)
            for old in [s for s in self._steps if s <= self._newest_step - self.cfg.keep_last_steps]:
                del self._steps[old]

    def _answer(self, step: int, rank: int) -> list[bytes] | None:
        """Reply frames for a request, or None while the step is not sent yet."""
        with self._lock:
            batches = self._steps.get(step)
            deleted = step <= self._newest_step - self.cfg.keep_last_steps
        if batches is None and not deleted:
            return None
        if batches is None:
            error = (
                f"step {step} was already deleted (transport.keep_last_steps = {self.cfg.keep_last_steps})"
            )
        elif not 0 <= rank < len(batches):
            error = f"rank {rank} asked for step {step}, which was packed for {len(batches)} ranks"
        else:
            header = json.dumps({"step": step, "rank": rank}).encode()
            return [header, batches[rank]]
        return [json.dumps({"error": error}).encode(), b""]

    def _serve(self) -> None:
        pending: list[tuple[bytes, int, int]] = []  # (peer identity, step, rank)
        timeout_ms = max(1, int(self.cfg.poll_interval_s * 1000))
        while not self._stop.is_set():
            if self._socket.poll(timeout_ms):
                identity, *frames = self._socket.recv_multipart()
                request = _parse_request(self._secret, frames)
                if request is None:
                    logger.warning("zmq batch server: dropped a malformed or badly signed request")
                else:
                    pending.append((identity, *request))
            still_pending = []
            for identity, step, rank in pending:
                reply = self._answer(step, rank)
                if reply is None:
                    still_pending.append((identity, step, rank))
                else:
                    self._socket.send_multipart([identity, *reply, _mac(self._secret, reply)])
            pending = still_pending

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close()
        self._context.term()


class ZmqReceiver:
    """Trainer side: asks the orchestrator's server for one rank's batch of a step."""

    def __init__(self, cfg: TransportConfig) -> None:
        self.cfg = cfg
        self._secret = _read_secret(cfg)
        self._address = f"tcp://{cfg.host}:{cfg.port}"
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(self._address)  # zmq queues the request until the server is up

    def receive(self, step: int, rank: int) -> list[MicroBatch]:
        request = [json.dumps({"step": step, "rank": rank}).encode()]
        self._socket.send_multipart([*request, _mac(self._secret, request)])
        deadline = time.monotonic() + self.cfg.receive_timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            if not self._socket.poll(int(remaining * 1000) + 1):
                continue
            frames = self._socket.recv_multipart()
            body = _verified(self._secret, frames) if len(frames) == 3 else None
            if body is None:
                raise ValueError(f"zmq batch from {self._address}: malformed or badly signed reply")
            header = json.loads(body[0])
            if "error" in header:
                raise ValueError(f"zmq batch server at {self._address}: {header['error']}")
            if (header["step"], header["rank"]) != (step, rank):
                continue  # a late answer to an earlier request that timed out
            got_step, got_rank, micro_batches = decode_rank_batch(body[1])
            if (got_step, got_rank) != (step, rank):
                raise ValueError(
                    f"zmq batch for step {step} rank {rank} holds step {got_step} rank {got_rank}"
                )
            return micro_batches
        raise TimeoutError(
            f"no batch for step {step} rank {rank} from {self._address} within "
            f"transport.receive_timeout_s = {self.cfg.receive_timeout_s} s; is the orchestrator running "
            "with transport.kind = 'zmq' and the same host/port?"
        )

    def close(self) -> None:
        self._socket.close()
        self._context.term()

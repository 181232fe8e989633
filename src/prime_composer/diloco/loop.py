"""``backend = "shardcast"``: the Streaming DiLoCo outer loop, called by the trainer after every
inner step (the ``OuterLoop`` contract of ``base.py``; the loss code never knows).

State per fragment ``f`` (flat float32 CPU vectors): the global weights ``theta_f`` every DC
agrees on, the outer momentum, and with error feedback the quantization residual. When a sync
of fragment ``f`` starts (``schedule.py``) the pseudo-gradient ``theta_f - local_f`` is quantized
and published, and the exchange (``exchange.py``) runs on a background thread while the trainer
takes ``tau`` more inner steps; then the agreed outer step gives the new ``theta_f`` and the local
fragment becomes ``alpha * local + (1 - alpha) * theta_f``. The contribution's weight is the
number of tokens this DC trained on since that fragment's previous sync.

A DC that starts after the others (a restart, a new machine) or falls out of step first catches
up: it downloads the newest agreed state of every fragment from the DCs that committed it, takes
the global weights as its local ones, and joins the next round.

``state_dict`` / ``save`` hold everything needed to resume exactly, including the own payload of
a sync still in flight (it is re-run on resume).

A DC whose trainer is sharded (FSDP2, ``trainer.num_ranks > 1``, across nodes too) joins as one
DC: rank 0 alone holds the outer state, runs the exchange and serves the origin; the other ranks
follow through collectives at the same schedule points (every rank calls ``after_inner_step``
with the same arguments). When a sync starts, the fragment is gathered to rank 0
(``Fragment.gather``); when it is applied, rank 0 broadcasts what to do (merge, catch up, nothing)
and scatters the new global fragment back, each rank keeping its shard (``Fragment.scatter``).
Memory: rank 0 holds the global weights and momentum in float32 (8 bytes a parameter, 12 with
error feedback), as a DC of one rank does; the other ranks hold no outer state, and every rank
holds at most one full parameter more while a fragment is gathered or scattered.

At the end of a run (``finish``) the sync still in flight is waited for and applied, and the
model takes the global weights of every fragment (the newest agreed state, the same bits in every
DC), which is what ``final/`` exports; the local progress since each fragment's last sync is kept
only in the last checkpoint (saved before ``finish``). ``close`` then keeps the origin up until
the peers have downloaded what they need of that last round (this DC's grad, its commit when it
coordinated; ``ShardcastStore.linger``), at most ``round_deadline_s``.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from prime_composer.checkpoint_layout import step_dir
from prime_composer.config.diloco import DilocoConfig
from prime_composer.config.errors import RunError
from prime_composer.diloco.base import Store, build_store, register_outer_loop
from prime_composer.diloco.exchange import Exchange, RoundResult
from prime_composer.diloco.fragments import Fragment, split_fragments
from prime_composer.diloco.part import CHECKPOINT_PART, read_part, write_part
from prime_composer.diloco.payload import encode, grad_body, tensor_digest
from prime_composer.diloco.quantize import dequantize, quantize
from prime_composer.diloco.schedule import FragmentSchedule

logger = logging.getLogger(__name__)


def read_secret(cfg: DilocoConfig) -> bytes | None:
    """The shared secret from ``cfg.secret_env`` (``ValueError`` naming the variable if unset)."""
    if cfg.secret_env is None:
        return None
    value = os.environ.get(cfg.secret_env)
    if not value:
        raise ValueError(
            f"diloco.secret_env = {cfg.secret_env!r}, but that environment variable is unset or empty: "
            f"export {cfg.secret_env}=<the run's shared secret> (the same value in every DC)"
        )
    return value.encode()


def make_store(cfg: DilocoConfig, work_dir: Path, secret: bytes | None) -> Store | None:
    """The store of this DC (``diloco.store``, from the registry), or None for a run without peers."""
    if not cfg.peers:
        return None
    return build_store(cfg, work_dir, secret)


@register_outer_loop("shardcast")
class ShardcastOuterLoop:
    """See the module docstring. ``optimizer`` is not used (the loop reads and writes the model's
    weights); ``store`` overrides the shardcast store (tests)."""

    def __init__(
        self,
        cfg: DilocoConfig,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        work_dir: Path,
        store: Store | None = None,
        catch_up: bool = True,
    ) -> None:
        if cfg.backend != "shardcast":
            raise ValueError(f'ShardcastOuterLoop runs backend = "shardcast", not {cfg.backend!r}')
        self.cfg = cfg
        self.work_dir = Path(work_dir)
        self.fragments: list[Fragment] = split_fragments(model, cfg.num_fragments)
        self.sharded = any(f.sharded for f in self.fragments)
        """FSDP2 shards: the DC's ranks run this loop together, rank 0 (``leader``) speaks for it."""
        self.leader = not self.sharded or dist.get_rank() == 0
        self.schedule = FragmentSchedule(cfg.sync_every, cfg.num_fragments, cfg.fragment_sync_delay)
        secret = read_secret(cfg)
        self.store = None
        if self.leader:
            self.store = store if store is not None else make_store(cfg, self.work_dir, secret)
        self.exchange = Exchange(cfg, self.store, secret, [f.layout_digest() for f in self.fragments])
        # The outer state lives on the leader; the others keep empty placeholders.
        gathered = [f.gather(self.leader) for f in self.fragments]
        self.theta = [t if t is not None else torch.empty(0) for t in gathered]
        self.momentum = [torch.zeros_like(t) for t in self.theta]
        self.residual: list[torch.Tensor] | None = (
            [torch.zeros_like(t) for t in self.theta] if cfg.error_feedback else None
        )
        self.num_updates = 0
        self.tokens = [0] * len(self.fragments)
        self.candidates = list(cfg.cluster_ids)
        self.last_metrics: dict[str, float] = {}
        """``diloco/round`` and the exchange's metrics (``exchange.py``) of the newest round."""
        self.last_result: RoundResult | None = None
        """The newest round this DC applied (its members, committer, new global fragment)."""
        self._pending: tuple[int, bytes] | None = None
        self._future: Future[RoundResult] | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diloco-exchange")
        self._lock = threading.Lock()
        if catch_up:
            up = self.exchange.wait_for_peers(cfg.round_deadline_s) if self.leader else self.exchange.peers
            if len(up) < len(self.exchange.peers):
                logger.warning(
                    "diloco: peers %s do not answer yet", sorted(set(self.exchange.peers) - set(up))
                )
            self.catch_up()

    # ---------------------------------------------------------------------------- the hook

    def after_inner_step(self, step: int, num_tokens: int, skipped: bool) -> bool:
        """Account for one inner step; start or apply a sync when the schedule says so.

        Returns True when the local weights changed (the trainer must republish them). A skipped
        update does not move the schedule.
        """
        if skipped:
            return False
        self.num_updates += 1
        self.tokens = [t + num_tokens for t in self.tokens]
        changed = False
        start = self.schedule.starts_after(self.num_updates)
        if start is not None:
            self._start(start)
        if self.schedule.applies_after(self.num_updates) is not None:
            changed = self._apply()
        return changed

    def _bcast(self, obj: Any) -> Any:
        """The leader's ``obj`` on every rank of the DC (itself without shards)."""
        if not self.sharded:
            return obj
        box = [obj if self.leader else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _start(self, round_: int) -> None:
        assert self._future is None, "one exchange at a time (tau < H/P)"
        f = self.schedule.fragment(round_)
        local = self.fragments[f].gather(self.leader)
        if local is None:  # a follower: the leader exchanges; it only tracks the schedule
            self.tokens[f] = 0
            self._pending = (round_, b"")
            return
        delta = self.theta[f] - local
        num_tokens = self.tokens[f]
        if not bool(torch.isfinite(delta).all()):
            # Non-finite local weights must not reach the global model: contribute nothing.
            logger.warning(
                "diloco: fragment %d has non-finite local weights; round %d sends zeros", f, round_
            )
            delta, num_tokens = torch.zeros_like(delta), 0
        if self.residual is not None:
            delta += self.residual[f]
        q = quantize(delta, self.cfg.quantization, self.cfg.block_size)
        if self.residual is not None:
            self.residual[f] = delta - dequantize(q)
        fields, body = grad_body(q, self.cfg.compression)
        header = self.exchange.header(
            "grad", round_, f, num_tokens=num_tokens, base_digest=tensor_digest(self.theta[f]), **fields
        )
        payload = encode(header, body, self.exchange.secret)
        self.tokens[f] = 0
        self._pending = (round_, payload)
        self._launch()

    def _launch(self) -> None:
        assert self._pending is not None
        round_, payload = self._pending
        f = self.schedule.fragment(round_)
        self._future = self._pool.submit(
            self.exchange.run_round,
            round_,
            f,
            payload,
            self.theta[f],
            self.momentum[f],
            list(self.candidates),
        )

    def _apply(self) -> bool:
        assert self._pending is not None
        f = self.schedule.fragment(self._pending[0])
        action = "none"
        if self.leader:
            assert self._future is not None
            try:
                result = self._future.result()
            except Exception as e:  # the followers must not wait for a broadcast that never comes
                self._future = None  # consumed: close() must not raise it again
                if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                    error: Exception = RunError(
                        f"diloco: no space left on the device of {e.filename or self.work_dir} while "
                        f"publishing round {self._pending[0]}: free space there or set diloco.data_dir "
                        "to a larger disk, then resume from the newest checkpoint"
                    )
                elif self.sharded:
                    error = RuntimeError(f"diloco: the exchange of round {self._pending[0]} failed: {e}")
                else:
                    raise
                if self.sharded:
                    self._bcast(("error", {}))
                raise error from (None if isinstance(error, RunError) else e)
            self._future = None
            self.last_result = result
            self.last_metrics = dict(result.metrics) | {"diloco/round": float(result.round)}
            if result.status != "applied":
                logger.warning("diloco: round %d %s; catching up from the peers", result.round, result.status)
                action = "catch_up"
            else:
                assert result.theta is not None and result.momentum is not None
                self.theta[f], self.momentum[f] = result.theta, result.momentum
                self.candidates = result.candidates
                action = "merge" if result.members else "none"
                logger.info(
                    "diloco: round %d (fragment %d) members %s committed by %s",
                    result.round,
                    f,
                    result.members,
                    result.committer,
                )
        self._pending = None
        action, self.last_metrics = self._bcast((action, self.last_metrics))
        if action == "error":
            raise RuntimeError("diloco: the exchange failed on rank 0 (see its log)")
        if action == "catch_up":
            self.catch_up(force=True)
            return True
        if action == "merge":
            self.fragments[f].scatter(self.theta[f] if self.leader else None, self.cfg.fragment_update_alpha)
        return bool(action == "merge")

    # --------------------------------------------------------------------------- catch up

    def catch_up(self, force: bool = False) -> bool:
        """Adopt the peers' newest agreed state if it is ahead of ours (or ``force``); returns
        whether it did. The local model becomes the global one and the schedule moves to the
        round after the newest commit."""
        changed = False
        for _ in range(3):  # commits may land while we download; go again until we are current
            decision: tuple[str, Any] = ("none", None)
            if self.leader:
                try:
                    newest_or_none = self._download_newer(force)
                    if newest_or_none is not None:
                        decision = ("adopt", newest_or_none)
                except RuntimeError as e:
                    decision = ("error", str(e))
            kind, value = self._bcast(decision)
            if kind == "error":
                raise RuntimeError(value)
            if kind == "none":
                return changed
            newest = int(value)
            force = False
            for f, fragment in enumerate(self.fragments):
                fragment.scatter(self.theta[f] if self.leader else None)
                if self.residual is not None:
                    self.residual[f].zero_()
            self.tokens = [0] * len(self.fragments)
            self.num_updates = self.schedule.start_of(newest) + self.cfg.fragment_sync_delay
            changed = True
            logger.info("diloco: caught up to round %d from the peers", newest)
        return changed

    def _download_newer(self, force: bool) -> int | None:
        """(Leader.) Download the peers' newest agreed state into ``theta``/``momentum`` if it is
        ahead of ours (or ``force``); its round, or None if there is nothing newer."""
        latest = self.exchange.latest_commit()
        if latest is None:
            return None
        newest, _ = latest
        if newest < self._next_round() and not force:
            return None
        states = []
        for r in range(max(0, newest - self.cfg.num_fragments + 1), newest + 1):
            f = self.schedule.fragment(r)
            got = self.exchange.fetch_state(r, f, self.fragments[f].numel)
            if got is None:
                raise RuntimeError(
                    f"diloco: cannot download the global state of round {r} from any peer; this DC "
                    "cannot rejoin (are the peers up, and is keep_rounds large enough?)"
                )
            states.append((r, f, *got))
        for r, f, commit, theta, momentum in states:
            self.theta[f], self.momentum[f] = theta, momentum
            if r == newest:
                self.candidates = [str(c) for c in commit["next_candidates"]]
        return newest

    def _next_round(self) -> int:
        """The next round this DC would start (the pending one if a sync is in flight)."""
        if self._pending is not None:
            return self._pending[0]
        return self.num_updates // self.schedule.steps_per_fragment

    # --------------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values (DCP- and safetensors-friendly) that resume this loop."""
        state: dict[str, Any] = {
            "num_updates": self.num_updates,
            "tokens": list(self.tokens),
            "candidates": list(self.candidates),
            "pending_round": -1 if self._pending is None else self._pending[0],
        }
        for f in range(len(self.fragments)):
            state[f"theta.{f}"] = self.theta[f]
            state[f"momentum.{f}"] = self.momentum[f]
            if self.residual is not None:
                state[f"residual.{f}"] = self.residual[f]
        if self._pending is not None:
            state["pending_payload"] = torch.frombuffer(bytearray(self._pending[1]), dtype=torch.uint8)
        return state

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore ``state_dict()`` (call it after the model's weights are restored; collective
        when sharded, where only the leader passes the state and the others None).

        If the peers went on meanwhile this DC catches up (the model takes the global weights);
        otherwise a sync that was in flight is run again with the same payload.
        """
        self._drain()
        pending_round = -1
        if self.leader:
            assert state is not None
            self.num_updates = int(state["num_updates"])
            self.tokens = [int(t) for t in state["tokens"]]
            self.candidates = [str(c) for c in state["candidates"]]
            for f in range(len(self.fragments)):
                self.theta[f] = state[f"theta.{f}"].clone()
                self.momentum[f] = state[f"momentum.{f}"].clone()
                if self.residual is not None:
                    self.residual[f] = state[f"residual.{f}"].clone()
            pending_round = int(state["pending_round"])
            if pending_round >= 0:
                self._pending = (pending_round, state["pending_payload"].numpy().tobytes())
        self.num_updates, pending_round = self._bcast((self.num_updates, pending_round))
        if not self.leader and pending_round >= 0:
            self._pending = (pending_round, b"")
        if self.catch_up():
            self._pending = None
        elif self._pending is not None and self.leader:
            self._launch()

    def save(self, root: Path, step: int) -> Path:
        """Write the ``diloco`` part of checkpoint ``step`` under ``root`` (``part.write_part``; the
        leader writes it, the other ranks of a sharded DC only return its directory)."""
        if not self.leader:
            return step_dir(root, step) / CHECKPOINT_PART
        return write_part(root, step, self.state_dict())

    def load(self, root: Path, step: int) -> None:
        """Restore the ``diloco`` part of checkpoint ``step``, verified against its manifest (see
        ``load_state_dict``)."""
        self.load_state_dict(read_part(root, step) if self.leader else None)

    def finish(self) -> None:
        """End of the run: wait for the sync in flight and apply it, then give the model the
        global weights of every fragment (collective when sharded). Call it after the last
        checkpoint and before exporting ``final/``."""
        if self._pending is not None:
            self._apply()
        for f, fragment in enumerate(self.fragments):
            fragment.scatter(self.theta[f] if self.leader else None)

    def global_digest(self) -> str:
        """SHA-256 over every fragment's global weights (equal in every DC after a round; the
        leader's, on every rank of a sharded DC)."""
        import hashlib

        h = hashlib.sha256()
        for t in self.theta:
            h.update(t.numpy().tobytes())
        return str(self._bcast(h.hexdigest()))

    def _drain(self) -> None:
        if self._future is not None:
            self._future.result()
            self._future, self._pending = None, None

    def close(self) -> None:
        """Wait for an exchange in flight, keep the origin up until the peers have what they need
        of the newest round (``Store.linger``, at most ``round_deadline_s``), stop it."""
        try:
            if self._future is not None:
                self._future.result()
        finally:
            self._pool.shutdown(wait=True)
            if self.store is not None:
                try:
                    owed = self.exchange.owed()
                    if owed:
                        self.store.linger(owed, self.cfg.round_deadline_s)
                finally:
                    self.store.close()

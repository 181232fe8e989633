"""One round of the all-to-all exchange: publish, gather, agree on the members, outer step.

Shardcast broadcasts one-to-many, so an all-to-all is N broadcasts plus an agreement on which
contributions a round averages; without it two DCs that saw different peers in time would end
with different global weights. The agreement here is a per-round commit by a coordinator:

1. every DC publishes its ``grad`` payload for round ``k`` (signed; it names the digest of the
   global fragment it was computed from, ``base_digest``) and downloads its peers';
2. the coordinator is the first of the round's *candidates* (the members of the previous commit,
   sorted; all DCs at the start) that is alive. It waits until every peer whose origin answers
   has sent its payload (but those that sent none in ``dead_after_rounds`` rounds in a row, until
   they post again), or ``round_deadline_s``, and publishes a ``commit``: the ordered members
   (cluster, payload digest, tokens) whose ``base_digest`` equals its own, and the next round's
   candidates. A late DC is simply not a member. Candidate ``j`` commits after
   ``(j + 1) * round_deadline_s`` if no earlier candidate has (failover); a DC that is not a
   candidate (it was left out) comes after them all;
3. every DC takes the first commit in candidate order, downloads any member payload it lacks,
   combines the dequantized pseudo-gradients *in the commit's order* (``aggregate.py``: uniform or
   capped token weights, norm clipping, mean or trimmed mean), and takes the outer step. Same
   inputs, same order, same float32 CPU operations: bit-identical results.
   The committer also publishes the fragment's new global weights and outer momentum (``state``),
   from which a restarted DC rebuilds the global model (``catch_up``).

A DC whose global fragment differs from the commit's ``base_digest`` (it missed a round), or that
cannot get a member's payload, reports ``diverged`` and catches up from the committers' states.

What a peer sends is validated before it touches the global model: every download is capped at
the largest size a valid payload of the fragment can have (``payload.max_payload_bytes``, passed
to ``Store.fetch`` and checked again by ``decode``); every payload is verified (signature, run,
sender, round, fragment, layout, settings); a grad's values must be finite after dequantization
and its token count an integer in bounds (``payload.parse_grad``); a commit must name distinct DCs
of the run, at least ``min_clusters`` of them unless none (``payload.check_commit``). A rejected
payload is fetched once and counted once per round and sender: its sender is out of that round
(``_rejected``). The committed members are then
combined by ``aggregate.py`` (weights, norm clipping, mean or trimmed mean), and an outer step
whose result is not finite is skipped (every DC skips it alike).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from prime_composer.config.diloco import DilocoConfig
from prime_composer.diloco.aggregate import aggregate
from prime_composer.diloco.base import Store
from prime_composer.diloco.outer_optim import outer_step
from prime_composer.diloco.payload import (
    GradPayload,
    Kind,
    PayloadError,
    check_commit,
    decode,
    encode,
    max_payload_bytes,
    parse_grad,
    parse_state,
    state_body,
    tensor_digest,
)

logger = logging.getLogger(__name__)

_PROBE_TIMEOUT_S = 2.0
_MAX_FETCH_ATTEMPTS = 3
"""Downloads of one listed grad that may fail (``None``) in a round before its sender is left out."""
_UNANSWERED_MEMBER_PROBES = 2
"""Probes in a row a committed member's origin may leave unanswered before a DC stops waiting for
its payload and catches up from the committer's state instead."""


@dataclass
class RoundResult:
    """What one round came to, for this DC."""

    round: int
    fragment: int
    status: str
    """``applied`` (an outer step or an agreed no-quorum round), ``diverged`` (catch up)."""
    members: list[str] = field(default_factory=list)
    candidates: list[str] = field(default_factory=list)
    theta: torch.Tensor | None = None
    momentum: torch.Tensor | None = None
    committer: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class Exchange:
    """The protocol above for one DC; ``store`` is None for a run with no peers."""

    def __init__(
        self, cfg: DilocoConfig, store: Store | None, secret: bytes | None, layouts: list[str]
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.secret = secret
        self.me = cfg.cluster_id
        self.peers = [c for c in cfg.cluster_ids if c != self.me]
        self.layouts = layouts
        self.rejected: Counter[str] = Counter()
        self._rejected: dict[tuple[int, str, str], str] = {}
        """``(round, cluster, kind)`` -> SHA-256 of the payload rejected (fetched once a round)."""
        self._attempts: Counter[tuple[int, str]] = Counter()
        self._missed: Counter[str] = Counter()
        """Rounds in a row each peer sent no payload in; ``dead_after_rounds`` of them: not waited for."""
        self._newest: tuple[int, str, list[str]] | None = None
        """``(round, committer, members)`` of the newest round this DC applied."""

    # --------------------------------------------------------------------------------- payloads

    def header(self, kind: Kind, round_: int, fragment: int, **fields: Any) -> dict[str, Any]:
        extra = {"validation": self.cfg.validation.model_dump()} if kind == "grad" else {}
        return {
            "run_id": self.cfg.run_id,
            "cluster": self.me,
            "kind": kind,
            "round": round_,
            "fragment": fragment,
            "layout": self.layouts[fragment],
            **extra,
            **fields,
        }

    def max_bytes(self, kind: Kind, numel: int) -> int:
        """The download cap of a ``kind`` payload of a fragment of ``numel`` values."""
        cfg = self.cfg
        return max_payload_bytes(kind, numel, cfg.quantization, cfg.block_size, cfg.compression)

    def _reject(self, reason: str, data: bytes, cluster: str, kind: Kind, round_: int, why: object) -> None:
        key = (round_, cluster, kind)
        if key not in self._rejected:  # counted once a round and sender
            self.rejected[reason] += 1
        self._rejected[key] = hashlib.sha256(data).hexdigest()
        logger.warning("diloco: rejected %s of round %d from %s: %s", kind, round_, cluster, why)

    def _verified(
        self, data: bytes, cluster: str, kind: Kind, round_: int, fragment: int, numel: int | None = None
    ) -> tuple[dict[str, Any], bytes] | None:
        expect = {
            "run_id": self.cfg.run_id,
            "cluster": cluster,
            "kind": kind,
            "round": round_,
            "fragment": fragment,
            "layout": self.layouts[fragment],
        }
        if kind == "grad":
            expect |= {
                "quantization": self.cfg.quantization,
                "block_size": self.cfg.block_size,
                "validation": self.cfg.validation.model_dump(),
            }
            if numel is not None:
                expect["numel"] = numel
        max_bytes = None if numel is None else self.max_bytes(kind, numel)
        try:
            header, body = decode(data, self.secret, expect, max_bytes)
            if kind == "commit":
                check_commit(header, self.cfg.cluster_ids, self.cfg.min_clusters)
            return header, body
        except PayloadError as e:
            self._reject(e.reason, data, cluster, kind, round_, e)
            return None

    def _grad(self, data: bytes, cluster: str, round_: int, fragment: int, numel: int) -> GradPayload | None:
        verified = self._verified(data, cluster, "grad", round_, fragment, numel)
        if verified is None:
            return None
        digest = hashlib.sha256(data).hexdigest()
        try:
            return parse_grad(*verified, digest=digest, max_num_tokens=self.cfg.validation.max_num_tokens)
        except PayloadError as e:
            self._reject(e.reason, data, cluster, "grad", round_, e)
        except (KeyError, ValueError, TypeError) as e:
            self._reject("malformed", data, cluster, "grad", round_, e)
        return None

    # ------------------------------------------------------------------------------------ round

    def run_round(
        self,
        round_: int,
        fragment: int,
        own_payload: bytes,
        theta: torch.Tensor,
        momentum: torch.Tensor,
        candidates: list[str],
    ) -> RoundResult:
        """Run round ``round_`` (publishing ``own_payload``) from the global fragment ``theta``
        and its momentum (neither is modified); see the module docstring."""
        t0 = time.monotonic()
        base_digest = tensor_digest(theta)
        for old in [k for k in self._rejected if k[0] < round_ - self.cfg.keep_rounds]:
            del self._rejected[old]
        for gone in [k for k in self._attempts if k[0] < round_]:
            del self._attempts[gone]
        own = self._grad(own_payload, self.me, round_, fragment, theta.numel())
        got: dict[str, GradPayload] = {}
        if own is not None:
            got[self.me] = own
        else:  # peers would reject it too: take part in the round without a contribution
            logger.error("diloco: this DC's own payload of round %d fails validation: not sent", round_)
        if self.store is None:
            alone = self._commit_header(round_, fragment, got, base_digest, candidates)
            return self._finish(round_, fragment, alone, got, theta, momentum, base_digest, t0)
        if own is not None:
            self.store.publish("grad", round_, own_payload)
        deadline = self.cfg.round_deadline_s
        # A DC left out of the last round comes last, so that it still commits when every
        # candidate before it is gone.
        order = candidates if self.me in candidates else [*candidates, self.me]
        my_index = order.index(self.me)
        watch = order[:my_index]
        commit: dict[str, Any] | None = None
        while commit is None:
            elapsed = time.monotonic() - t0
            alive = self._poll_grads(round_, fragment, got, theta.numel())
            commit = self._find_commit(round_, fragment, watch, theta.numel())
            if commit is not None:
                break
            waiting_for = [
                c for c in alive if c not in got and not self._left_out(round_, c) and not self._dead(c)
            ]
            if (my_index == 0 and not waiting_for) or elapsed >= (my_index + 1) * deadline:
                commit = self._commit_header(round_, fragment, got, base_digest, candidates)
                self.store.publish("commit", round_, encode(commit, b"", self.secret))
                break
            if elapsed >= (len(order) + 1) * deadline:  # cannot happen unless publishing fails
                logger.warning("diloco: no commit for round %d after %.0f s", round_, elapsed)
                return RoundResult(round_, fragment, "diverged", metrics=self._metrics(t0, got))
            time.sleep(self.cfg.poll_interval_s)
        for cluster in self.peers:
            self._missed[cluster] = 0 if cluster in got else self._missed[cluster] + 1
        return self._finish(round_, fragment, commit, got, theta, momentum, base_digest, t0)

    def _dead(self, cluster: str) -> bool:
        """``cluster`` sent nothing in the last ``dead_after_rounds`` rounds: not waited for."""
        return self._missed[cluster] >= self.cfg.dead_after_rounds

    def _left_out(self, round_: int, cluster: str) -> bool:
        """``cluster``'s grad of ``round_`` was rejected, or failed to download too often."""
        return (round_, cluster, "grad") in self._rejected or self._attempts[
            (round_, cluster)
        ] >= _MAX_FETCH_ATTEMPTS

    def _poll_grads(self, round_: int, fragment: int, got: dict[str, GradPayload], numel: int) -> list[str]:
        """One pass over the peers: fetch the grads newly published; returns the peers that answer."""
        assert self.store is not None
        alive = []
        for cluster in self.peers:
            if cluster in got:
                alive.append(cluster)
                continue
            if self._left_out(round_, cluster):
                continue
            listed = self.store.available(cluster, _PROBE_TIMEOUT_S)
            if listed is None:
                continue
            alive.append(cluster)
            if ("grad", round_) in listed or ("grad", round_ - 1) in listed:
                self._missed[cluster] = 0  # posting again (the last round's came late): wait for it
            if ("grad", round_) in listed:
                data = self.store.fetch(
                    cluster,
                    "grad",
                    round_,
                    self.cfg.round_deadline_s,
                    max_bytes=self.max_bytes("grad", numel),
                )
                if data is None:
                    self._attempts[(round_, cluster)] += 1
                elif (grad := self._grad(data, cluster, round_, fragment, numel)) is not None:
                    got[cluster] = grad
        return alive

    def _find_commit(self, round_: int, fragment: int, watch: list[str], numel: int) -> dict[str, Any] | None:
        """The commit of the first candidate in ``watch`` that has published a valid one."""
        assert self.store is not None
        for cluster in watch:
            if (round_, cluster, "commit") in self._rejected:
                continue
            data = self.store.fetch(
                cluster, "commit", round_, _PROBE_TIMEOUT_S, max_bytes=self.max_bytes("commit", numel)
            )
            if data is None:
                continue
            verified = self._verified(data, cluster, "commit", round_, fragment, numel)
            if verified is not None:
                return verified[0]
        return None

    def _commit_header(
        self,
        round_: int,
        fragment: int,
        got: dict[str, GradPayload],
        base_digest: str,
        candidates: list[str],
    ) -> dict[str, Any]:
        members = sorted(c for c, g in got.items() if g.base_digest == base_digest)
        for c in sorted(set(got) - set(members)):
            logger.warning("diloco: %s computed round %d from other global weights: left out", c, round_)
        if len(members) < self.cfg.min_clusters:
            logger.warning(
                "diloco: round %d has %d contribution(s), below min_clusters = %d: no outer step",
                round_,
                len(members),
                self.cfg.min_clusters,
            )
            agreed: list[str] = []
        else:
            agreed = members
        return self.header(
            "commit",
            round_,
            fragment,
            base_digest=base_digest,
            members=[[c, got[c].digest, got[c].num_tokens] for c in agreed],
            next_candidates=agreed or candidates,
        )

    def _finish(
        self,
        round_: int,
        fragment: int,
        commit: dict[str, Any],
        got: dict[str, GradPayload],
        theta: torch.Tensor,
        momentum: torch.Tensor,
        base_digest: str,
        t0: float,
    ) -> RoundResult:
        committer = str(commit["cluster"])
        if commit["base_digest"] != base_digest:
            logger.warning("diloco: round %d was committed from other global weights than ours", round_)
            return RoundResult(round_, fragment, "diverged", metrics=self._metrics(t0, got))
        members_grads: list[GradPayload] = []
        for cluster, digest, _ in commit["members"]:
            grad = got.get(cluster)
            if grad is None or grad.digest != digest:
                grad = self._fetch_member(round_, fragment, cluster, digest, theta.numel())
            if grad is None:
                logger.warning("diloco: cannot get a valid %s payload of round %d", cluster, round_)
                return RoundResult(round_, fragment, "diverged", metrics=self._metrics(t0, got))
            members_grads.append(grad)
        new_theta, new_momentum = theta.clone(), momentum.clone()
        extra: dict[str, float] = {}
        if members_grads:
            # The token counts are the payloads' own (the commit names their digests).
            combined = aggregate(
                [g.num_tokens for g in members_grads], [g.values for g in members_grads], self.cfg.validation
            )
            extra["diloco/num_clipped"] = float(len(combined.clipped))
            for i in combined.clipped:
                logger.warning(
                    "diloco: %s's pseudo-gradient of round %d (norm %.3g) is clipped by the norm rule",
                    members_grads[i].cluster,
                    round_,
                    combined.norms[i],
                )
            outer_step(new_theta, new_momentum, combined.grad, self.cfg.outer)
            if not (bool(torch.isfinite(new_theta).all()) and bool(torch.isfinite(new_momentum).all())):
                logger.warning("diloco: the outer step of round %d is not finite: skipped", round_)
                new_theta, new_momentum = theta.clone(), momentum.clone()
                extra["diloco/skipped_non_finite"] = 1.0
        if committer == self.me and self.store is not None:
            header = self.header("state", round_, fragment, digest=tensor_digest(new_theta))
            self.store.publish(
                "state", round_, encode(header, state_body(new_theta, new_momentum), self.secret)
            )
        members = [str(m[0]) for m in commit["members"]]
        self._newest = (round_, committer, members)
        metrics = self._metrics(t0, got) | {"diloco/num_members": float(len(members))} | extra
        return RoundResult(
            round_,
            fragment,
            "applied",
            members=members,
            candidates=[str(c) for c in commit["next_candidates"]],
            theta=new_theta,
            momentum=new_momentum,
            committer=committer,
            metrics=metrics,
        )

    def owed(self) -> dict[str, list[tuple[Kind, int]]]:
        """What each peer may still need from this DC's origin to apply the newest round this DC
        applied: every other member this DC's grad (if it is a member), every peer the commit (if
        this DC committed it). ``Store.linger`` keeps the origin up until they have it."""
        if self._newest is None or self.store is None:
            return {}
        round_, committer, members = self._newest
        owed: dict[str, list[tuple[Kind, int]]] = {}
        for peer in self.peers:
            items: list[tuple[Kind, int]] = []
            if self.me in members and peer in members:
                items.append(("grad", round_))
            if committer == self.me:
                items.append(("commit", round_))
            if items:
                owed[peer] = items
        return owed

    def _fetch_member(
        self, round_: int, fragment: int, cluster: str, digest: str, numel: int
    ) -> GradPayload | None:
        if self.store is None or self._rejected.get((round_, cluster, "grad")) == digest:
            return None  # a payload this DC rejected: the commit cannot be applied here
        until = time.monotonic() + self.cfg.round_deadline_s
        unanswered = 0
        while time.monotonic() < until:
            data = self.store.fetch(
                cluster, "grad", round_, self.cfg.round_deadline_s, max_bytes=self.max_bytes("grad", numel)
            )
            if data is not None and hashlib.sha256(data).hexdigest() == digest:
                return self._grad(data, cluster, round_, fragment, numel)
            # A member whose origin stopped answering (it died after the committer took its payload)
            # will not serve it within the deadline: catch up from the committer's state now.
            unanswered = unanswered + 1 if self.store.available(cluster, _PROBE_TIMEOUT_S) is None else 0
            if unanswered >= _UNANSWERED_MEMBER_PROBES:
                logger.warning("diloco: %s does not answer for its payload of round %d", cluster, round_)
                return None
            time.sleep(self.cfg.poll_interval_s)
        return None

    def _metrics(self, t0: float, got: dict[str, GradPayload]) -> dict[str, float]:
        return {
            "diloco/round_s": time.monotonic() - t0,
            "diloco/num_received": float(len(set(got) - {self.me})),
            "diloco/num_dead_peers": float(sum(self._dead(c) for c in self.peers)),
            **{f"diloco/rejected/{k}": float(v) for k, v in self.rejected.items()},
        }

    # ------------------------------------------------------------------------------- catch up

    def wait_for_peers(self, timeout_s: float) -> list[str]:
        """Wait until every peer's origin answers or ``timeout_s`` passes; returns those that do.

        Called once at start-up, so DCs launched a few seconds apart all make the first round."""
        if self.store is None:
            return []
        until = time.monotonic() + timeout_s
        while True:
            up = [c for c in self.peers if self.store.available(c, _PROBE_TIMEOUT_S) is not None]
            if len(up) == len(self.peers) or time.monotonic() >= until:
                return up
            time.sleep(self.cfg.poll_interval_s)

    def latest_commit(self) -> tuple[int, str] | None:
        """``(round, committer)`` of the newest commit any reachable peer serves."""
        if self.store is None:
            return None
        best: tuple[int, str] | None = None
        for cluster in self.peers:
            listed = self.store.available(cluster, _PROBE_TIMEOUT_S)
            for kind, r in listed or ():
                if kind == "commit" and (best is None or r > best[0]):
                    best = (r, cluster)
        return best

    def fetch_state(
        self, round_: int, fragment: int, numel: int
    ) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor] | None:
        """``(commit, theta, momentum)`` after round ``round_``, from its committer."""
        assert self.store is not None
        for cluster in self.peers:
            data = self.store.fetch(
                cluster,
                "commit",
                round_,
                self.cfg.round_deadline_s,
                max_bytes=self.max_bytes("commit", numel),
            )
            if data is None:
                continue
            verified = self._verified(data, cluster, "commit", round_, fragment, numel)
            if verified is None:
                continue
            state = self.store.fetch(
                cluster, "state", round_, self.cfg.round_deadline_s, max_bytes=self.max_bytes("state", numel)
            )
            if state is None:
                return None
            checked = self._verified(state, cluster, "state", round_, fragment, numel)
            if checked is None:
                return None
            header, body = checked
            theta, momentum = parse_state(body, numel)
            if tensor_digest(theta) != header["digest"]:
                self.rejected["checksum"] += 1
                return None
            return verified[0], theta, momentum
        return None

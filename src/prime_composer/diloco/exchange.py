"""One round of the all-to-all exchange: publish, gather, agree on the members, outer step.

Shardcast broadcasts one-to-many, so an all-to-all is N broadcasts plus an agreement on which
contributions a round averages; without it two DCs that saw different peers in time would end
with different global weights. The agreement here is a per-round commit by a coordinator:

1. every DC publishes its ``grad`` payload for round ``k`` (signed; it names the digest of the
   global fragment it was computed from, ``base_digest``) and downloads its peers';
2. the coordinator is the first of the round's *candidates* (the members of the previous commit,
   sorted; all DCs at the start) that is alive. It waits until every peer whose origin answers
   has sent its payload, or ``round_deadline_s``, and publishes a ``commit``: the ordered members
   (cluster, payload digest, tokens) whose ``base_digest`` equals its own, and the next round's
   candidates. A late DC is simply not a member. Candidate ``j`` commits after
   ``(j + 1) * round_deadline_s`` if no earlier candidate has (failover); a DC that is not a
   candidate (it was left out) comes after them all;
3. every DC takes the first commit in candidate order, downloads any member payload it lacks,
   averages the dequantized pseudo-gradients weighted by tokens *in the commit's order*, and takes
   the outer step. Same inputs, same order, same float32 CPU operations: bit-identical results.
   The committer also publishes the fragment's new global weights and outer momentum (``state``),
   from which a restarted DC rebuilds the global model (``catch_up``).

A DC whose global fragment differs from the commit's ``base_digest`` (it missed a round), or that
cannot get a member's payload, reports ``diverged`` and catches up from the committers' states.
Every payload is verified (``payload.decode``); rejected ones are counted by reason.
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
from prime_composer.diloco.base import Store
from prime_composer.diloco.outer_optim import outer_step, weighted_average
from prime_composer.diloco.payload import (
    GradPayload,
    Kind,
    PayloadError,
    decode,
    encode,
    parse_grad,
    parse_state,
    state_body,
    tensor_digest,
)
from prime_composer.diloco.quantize import dequantize

logger = logging.getLogger(__name__)

_PROBE_TIMEOUT_S = 2.0


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

    # --------------------------------------------------------------------------------- payloads

    def header(self, kind: Kind, round_: int, fragment: int, **fields: Any) -> dict[str, Any]:
        return {
            "run_id": self.cfg.run_id,
            "cluster": self.me,
            "kind": kind,
            "round": round_,
            "fragment": fragment,
            "layout": self.layouts[fragment],
            **fields,
        }

    def _verified(
        self, data: bytes, cluster: str, kind: Kind, round_: int, fragment: int
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
            expect |= {"quantization": self.cfg.quantization, "block_size": self.cfg.block_size}
        try:
            return decode(data, self.secret, expect)
        except PayloadError as e:
            self.rejected[e.reason] += 1
            logger.warning("diloco: rejected %s of round %d from %s: %s", kind, round_, cluster, e)
            return None

    def _grad(self, data: bytes, cluster: str, round_: int, fragment: int) -> GradPayload | None:
        verified = self._verified(data, cluster, "grad", round_, fragment)
        if verified is None:
            return None
        try:
            return parse_grad(*verified, digest=hashlib.sha256(data).hexdigest())
        except (PayloadError, KeyError, ValueError, TypeError) as e:
            self.rejected["malformed"] += 1
            logger.warning("diloco: rejected grad of round %d from %s: %s", round_, cluster, e)
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
        own = self._grad(own_payload, self.me, round_, fragment)
        assert own is not None, "own payload must verify"
        got: dict[str, GradPayload] = {self.me: own}
        if self.store is None:
            alone = self._commit_header(round_, fragment, got, base_digest, candidates)
            return self._finish(round_, fragment, alone, got, theta, momentum, base_digest, t0)
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
            alive = self._poll_grads(round_, fragment, got)
            commit = self._find_commit(round_, fragment, watch)
            if commit is not None:
                break
            waiting_for = [c for c in alive if c not in got]
            if (my_index == 0 and not waiting_for) or elapsed >= (my_index + 1) * deadline:
                commit = self._commit_header(round_, fragment, got, base_digest, candidates)
                self.store.publish("commit", round_, encode(commit, b"", self.secret))
                break
            if elapsed >= (len(order) + 1) * deadline:  # cannot happen unless publishing fails
                logger.warning("diloco: no commit for round %d after %.0f s", round_, elapsed)
                return RoundResult(round_, fragment, "diverged", metrics=self._metrics(t0, got))
            time.sleep(self.cfg.poll_interval_s)
        return self._finish(round_, fragment, commit, got, theta, momentum, base_digest, t0)

    def _poll_grads(self, round_: int, fragment: int, got: dict[str, GradPayload]) -> list[str]:
        """One pass over the peers: fetch the grads newly published; returns the peers that answer."""
        assert self.store is not None
        alive = []
        for cluster in self.peers:
            if cluster in got:
                alive.append(cluster)
                continue
            listed = self.store.available(cluster, _PROBE_TIMEOUT_S)
            if listed is None:
                continue
            alive.append(cluster)
            if ("grad", round_) in listed:
                data = self.store.fetch(cluster, "grad", round_, self.cfg.round_deadline_s)
                if data is not None and (grad := self._grad(data, cluster, round_, fragment)) is not None:
                    got[cluster] = grad
        return alive

    def _find_commit(self, round_: int, fragment: int, watch: list[str]) -> dict[str, Any] | None:
        """The commit of the first candidate in ``watch`` that has published one."""
        assert self.store is not None
        for cluster in watch:
            data = self.store.fetch(cluster, "commit", round_, _PROBE_TIMEOUT_S)
            if data is None:
                continue
            verified = self._verified(data, cluster, "commit", round_, fragment)
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
        contributions: list[tuple[float, torch.Tensor]] = []
        for cluster, digest, num_tokens in commit["members"]:
            grad = got.get(cluster)
            if grad is None or grad.digest != digest:
                grad = self._fetch_member(round_, fragment, cluster, digest)
            if grad is None:
                logger.warning("diloco: cannot get %s's payload of round %d", cluster, round_)
                return RoundResult(round_, fragment, "diverged", metrics=self._metrics(t0, got))
            contributions.append((float(num_tokens), dequantize(grad.quantized)))
        new_theta, new_momentum = theta.clone(), momentum.clone()
        if contributions:
            outer_step(new_theta, new_momentum, weighted_average(contributions), self.cfg.outer)
        if committer == self.me and self.store is not None:
            header = self.header("state", round_, fragment, digest=tensor_digest(new_theta))
            self.store.publish(
                "state", round_, encode(header, state_body(new_theta, new_momentum), self.secret)
            )
        members = [str(m[0]) for m in commit["members"]]
        metrics = self._metrics(t0, got) | {"diloco/num_members": float(len(members))}
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

    def _fetch_member(self, round_: int, fragment: int, cluster: str, digest: str) -> GradPayload | None:
        if self.store is None:
            return None
        until = time.monotonic() + self.cfg.round_deadline_s
        while time.monotonic() < until:
            data = self.store.fetch(cluster, "grad", round_, self.cfg.round_deadline_s)
            if data is not None and hashlib.sha256(data).hexdigest() == digest:
                return self._grad(data, cluster, round_, fragment)
            time.sleep(self.cfg.poll_interval_s)
        return None

    def _metrics(self, t0: float, got: dict[str, GradPayload]) -> dict[str, float]:
        return {
            "diloco/round_s": time.monotonic() - t0,
            "diloco/num_received": float(len(got) - 1),
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
            data = self.store.fetch(cluster, "commit", round_, self.cfg.round_deadline_s)
            if data is None:
                continue
            verified = self._verified(data, cluster, "commit", round_, fragment)
            if verified is None:
                continue
            state = self.store.fetch(cluster, "state", round_, self.cfg.round_deadline_s)
            if state is None:
                return None
            checked = self._verified(state, cluster, "state", round_, fragment)
            if checked is None:
                return None
            header, body = checked
            theta, momentum = parse_state(body, numel)
            if tensor_digest(theta) != header["digest"]:
                self.rejected["checksum"] += 1
                return None
            return verified[0], theta, momentum
        return None

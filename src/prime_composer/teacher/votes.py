"""From teacher votes to a step label: a DPO pair, a confirmation, or neither; and a process reward.

Votes are clustered by canonical action (``actions.Action.key``); shares are over the teachers that
answered with a valid action (a failed or malformed answer abstains). With ``s_trace`` the share
of the trace's own action and ``s_best`` the largest share of any other action:

- **pair** when ``s_best >= kappa``, ``s_best - s_trace >= delta`` and there are at least
  ``min_votes`` valid votes: chosen = the majority's action, rejected = the trace's;
  label smoothing ``min(max_label_smoothing, 1 - s_best)`` (the chance the majority is wrong, as
  far as the votes can tell);
- **confirmed** when ``s_trace >= kappa``;
- **undecided** otherwise; **no_votes** when no teacher gave a valid action.

The process reward of the step is ``s_trace - s_best`` in [-1, 1]: +1 when every teacher would
have done what the trace did, -1 when they all agree on something else. Ties between clusters go
to the one whose first vote comes earliest in pool order, so labels are deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from prime_composer.config.teacher import PairConfig
from prime_composer.teacher.actions import Action

Outcome = Literal["pair", "confirmed", "undecided", "no_votes"]


@dataclass(frozen=True)
class Vote:
    """One teacher's answer at a step."""

    teacher: str
    action: Action | None
    """None when the call failed or the answer held no action."""
    cost_usd: float = 0.0
    error: str | None = None


@dataclass(frozen=True)
class StepLabel:
    outcome: Outcome
    process_reward: float
    trace_share: float
    best_share: float
    num_votes: int
    """Valid votes."""
    chosen: Action | None = None
    """The majority's action (pairs only)."""
    label_smoothing: float = 0.0
    clusters: dict[str, list[str]] = field(default_factory=dict)
    """Cluster key -> teachers who voted for it."""

    @property
    def margin(self) -> float:
        return self.best_share - self.trace_share


def process_reward(action_key: str, vote_keys: list[str]) -> float:
    """The process reward of the action with cluster key ``action_key`` at a state whose valid teacher
    votes are ``vote_keys``: its share minus the largest share of any other action (the formula of
    ``label_step``, for any action at a labeled state). 0 when there is no vote."""
    if not vote_keys:
        return 0.0
    counts: dict[str, int] = {}
    for key in vote_keys:
        counts[key] = counts.get(key, 0) + 1
    best_other = max((n for key, n in counts.items() if key != action_key), default=0)
    return (counts.get(action_key, 0) - best_other) / len(vote_keys)


def label_step(trace_action: Action, votes: list[Vote], cfg: PairConfig) -> StepLabel:
    """Label one step from its votes (see the module docstring)."""
    clusters: dict[str, list[str]] = {}
    representative: dict[str, Action] = {}
    for vote in votes:
        if vote.action is None:
            continue
        key = vote.action.key
        clusters.setdefault(key, []).append(vote.teacher)
        representative.setdefault(key, vote.action)
    num_votes = sum(len(v) for v in clusters.values())
    if num_votes == 0:
        return StepLabel("no_votes", 0.0, 0.0, 0.0, 0, clusters=clusters)
    trace_key = trace_action.key
    trace_share = len(clusters.get(trace_key, [])) / num_votes
    others = [(len(teachers), key) for key, teachers in clusters.items() if key != trace_key]
    # max() keeps the first of equal counts: dict order is the order of the first vote.
    best_count, best_key = max(others, key=lambda item: item[0]) if others else (0, None)
    best_share = best_count / num_votes
    reward = trace_share - best_share
    if (
        best_key is not None
        and num_votes >= cfg.min_votes
        and best_share >= cfg.kappa
        and best_share - trace_share >= cfg.delta
    ):
        smoothing = min(cfg.max_label_smoothing, 1.0 - best_share)
        return StepLabel(
            "pair",
            reward,
            trace_share,
            best_share,
            num_votes,
            chosen=representative[best_key],
            label_smoothing=smoothing,
            clusters=clusters,
        )
    outcome: Outcome = "confirmed" if trace_share >= cfg.kappa else "undecided"
    return StepLabel(outcome, reward, trace_share, best_share, num_votes, clusters=clusters)

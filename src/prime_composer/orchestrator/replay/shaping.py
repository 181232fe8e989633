"""Process rewards of the teacher service as a shaping term of the RL advantages (optional).

With ``orchestrator.advantage.process_reward_weight = w > 0``, each finished rollout is looked up in
the service's store before its group's advantages are computed: the rollout is written as the
trace the service would replay (``replay/traces.py``), and at each of its steps (assistant turns)
whose *state* (task, tools, earlier turns: ``Trace.state_hash``) the teachers have already labeled,
the step's process reward is that of the rollout's own action given the teachers' votes there
(``teacher.votes.process_reward``: its vote share minus the largest share of any other action, in
[-1, 1]). The rollout's process reward is the mean over its labeled steps, and
``compute_advantages`` adds ``w`` times it to the reward before the group baseline. A rollout with no
labeled step gets nothing added.

The states repeat: a group's rollouts share their first state, tasks are drawn again, and teacher
answers are cached per state, so a rollout is usually shaped by labels that earlier rollouts at the
same state paid for, not by its own (which the service labels after this step).
"""

from __future__ import annotations

import logging
from pathlib import Path

from prime_composer.config.teacher import TraceSourceConfig
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.trace_export import episode_trace, episodes
from prime_composer.teacher.actions import turn_action
from prime_composer.teacher.pairs import PairStore
from prime_composer.teacher.traces import TraceError, parse_trace
from prime_composer.teacher.votes import process_reward

logger = logging.getLogger(__name__)

_LIMITS = TraceSourceConfig(max_line_bytes=2**62, max_turns=2**31, max_turn_chars=2**62)
"""Rollouts are the run's own: no import limits."""


class ProcessRewards:
    """Looks up the process reward of finished rollouts in the teacher service's store."""

    def __init__(self, store: Path) -> None:
        self.store = PairStore(store)
        self.num_looked_up = 0
        self.num_shaped = 0

    def close(self) -> None:
        self.store.close()

    def lookup(self, samples: list[Sample]) -> list[float | None]:
        """Per sample (same order): the mean process reward of its labeled steps, or None. The
        Samples of one episode (same ``episode.trace_id`` with per-turn records) get the
        episode's value."""
        reward: dict[int, float | None] = {}
        for group in episodes(samples):
            record = episode_trace(group)
            value = self._reward(record) if record is not None else None
            reward.update((id(sample), value) for sample in group)
        out = [reward[id(sample)] for sample in samples]
        self.num_looked_up += len(samples)
        self.num_shaped += sum(r is not None for r in out)
        return out

    def _reward(self, record: dict[str, object]) -> float | None:
        try:
            trace = parse_trace(record, "rollout", _LIMITS)
        except TraceError as e:  # a rollout that is no valid trace is simply not shaped
            logger.debug("rollout not looked up: %s", e)
            return None
        rewards = []
        for k in trace.step_indices:
            votes = self.store.votes_at(trace.state_hash(k))
            if votes:
                rewards.append(process_reward(turn_action(trace.turns[k]).key, votes))
        return sum(rewards) / len(rewards) if rewards else None

    def metrics(self) -> dict[str, float]:
        """Rollouts looked up and shaped so far."""
        return {"replay/shaping_looked_up": self.num_looked_up, "replay/shaping_shaped": self.num_shaped}

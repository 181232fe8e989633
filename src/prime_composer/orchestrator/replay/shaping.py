"""Process rewards of the teacher service as a shaping term of the RL advantages (optional).

With ``orchestrator.advantage.process_reward_weight = w > 0``, each finished rollout is looked up in
the service's store before its group's advantages are computed: the rollout is written as the
trace the service would replay (``trace_export.py``), and at each of its steps (assistant turns)
whose *state* (task, tools, earlier turns: ``Trace.state_hash``) the teachers have already labeled,
the step's process reward is that of the rollout's own action given the teachers' votes there
(``teacher.votes.process_reward``: its vote share minus the largest share of any other action, in
[-1, 1]). The rollout's process reward is the mean over its labeled steps, and
``compute_advantages`` adds ``w`` times it to the reward before the group baseline. A rollout with no
labeled step gets nothing added. With ``process_reward_credit = "step"`` or ``"return"`` each turn's
own reward is kept too (``ProcessReward.steps``: its turn number and token span), and
``compute_advantages`` credits it to that turn's tokens instead.

The states repeat: a group's rollouts share their first state, tasks are drawn again, and teacher
answers are cached per state, so a rollout is usually shaped by labels that earlier rollouts at the
same state paid for, not by its own (which the service labels after this step).
"""

from __future__ import annotations

from prime_composer.orchestrator.sample import ProcessReward, Sample, StepReward
from prime_composer.orchestrator.trace_export import episode_steps, episode_trace, episodes
from prime_composer.teacher.client import TeacherClient


class ProcessRewards:
    """Looks up the process reward of finished rollouts in the teacher service's store."""

    def __init__(self, teacher: TeacherClient) -> None:
        self.teacher = teacher
        self.num_looked_up = 0
        self.num_shaped = 0

    def lookup(self, samples: list[Sample]) -> list[ProcessReward | None]:
        """Per sample (same order): its episode's mean process reward over the labeled steps with
        the reward of each of the Sample's own turns (``ProcessReward``), or None when no step is
        labeled. The Samples of one episode (same ``episode.trace_id`` with per-turn records)
        share the mean; each has its own turns."""
        reward: dict[int, ProcessReward | None] = {}
        for group in episodes(samples):
            record = episode_trace(group)
            values = self.teacher.step_process_rewards(record) if record is not None else None
            labeled = [v for v in values or [] if v is not None]
            if values is None or not labeled:
                reward.update((id(sample), None) for sample in group)
                continue
            mean = sum(labeled) / len(labeled)
            turns: dict[int, list[StepReward]] = {id(sample): [] for sample in group}
            for value, step in zip(values, episode_steps(group), strict=True):
                if step is not None:
                    sample, turn = step
                    turns[id(sample)].append(StepReward(turn.index, turn.span, value))
            reward.update((id(s), ProcessReward(mean, tuple(turns[id(s)]))) for s in group)
        out = [reward[id(sample)] for sample in samples]
        self.num_looked_up += len(samples)
        self.num_shaped += sum(r is not None for r in out)
        return out

    def metrics(self) -> dict[str, float]:
        """Rollouts looked up and shaped so far."""
        return {"replay/shaping_looked_up": self.num_looked_up, "replay/shaping_shaped": self.num_shaped}

"""Process-reward shaping of the advantages (``orchestrator.advantage.process_reward_weight``),
checked against hand computations; the lookup is checked against labels written into a real store."""

from __future__ import annotations

from pathlib import Path

import pytest

from prime_composer.config.advantage import AdvantageConfig
from prime_composer.config.errors import ConfigError
from prime_composer.config.resolve import resolve_rl_config
from prime_composer.config.teacher import PairConfig, TraceSourceConfig
from prime_composer.orchestrator.advantages import compute_advantages, filter_zero_variance
from prime_composer.orchestrator.record import EpisodeRecord
from prime_composer.orchestrator.replay.shaping import ProcessRewards
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.trace_export import episode_trace
from prime_composer.teacher.actions import Action
from prime_composer.teacher.client import TeacherClient
from prime_composer.teacher.service import _summary
from prime_composer.teacher.store import PlannedStep, TeacherStore
from prime_composer.teacher.traces import parse_trace
from prime_composer.teacher.votes import Vote, label_step, process_reward


def rollout(question: str, answer: str, reward: float, group_id: int = 0) -> Sample:
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return Sample(
        [1, 2, 3],
        [4, 5],
        [-0.5, -0.5],
        [1, 1],
        reward,
        0,
        group_id,
        0,
        episode=EpisodeRecord(messages=messages),
    )


def test_shaping_adds_the_weighted_process_reward_before_the_baseline() -> None:
    samples = [rollout("q", "a", 1.0), rollout("q", "b", 0.0), rollout("q", "c", 0.0)]
    cfg = AdvantageConfig(process_reward_weight=0.5)
    out = compute_advantages(samples, cfg, process_rewards=[None, -1.0, 0.5])
    # shaped = [1 + 0, 0 - 0.5, 0 + 0.25] = [1, -0.5, 0.25]; mean 0.25
    assert [s.advantage for s in out] == pytest.approx([0.75, -0.75, 0.0], abs=1e-15)
    assert [s.reward for s in out] == [1.0, 0.0, 0.0]  # the environment's reward is kept
    assert "process_reward" not in out[0].metrics and out[1].metrics["process_reward"] == -1.0
    # GRPO std scaling sees the shaped values: sample std of [1, -0.5, 0.25] is 0.75
    scaled = compute_advantages(
        samples,
        AdvantageConfig(process_reward_weight=0.5, std_scaling=True),
        process_rewards=[None, -1.0, 0.5],
    )
    assert [s.advantage for s in scaled] == pytest.approx([0.75 / (0.75 + 1e-4), -0.75 / (0.75 + 1e-4), 0.0])


def test_shaping_can_make_an_all_equal_group_trainable() -> None:
    # Two wrong answers, one of which the teachers prefer: dynamic sampling keeps the group.
    samples = [rollout("q", "a", 0.0), rollout("q", "b", 0.0)]
    plain, dropped = filter_zero_variance(compute_advantages(samples, AdvantageConfig()))
    assert plain == [] and dropped == 1
    shaped = compute_advantages(
        samples, AdvantageConfig(process_reward_weight=0.2), process_rewards=[1.0, -1.0]
    )
    assert [s.advantage for s in shaped] == pytest.approx([0.2, -0.2])


def test_weight_zero_is_bitwise_the_unshaped_computation() -> None:
    samples = [rollout("q", str(i), r, group_id=i % 2) for i, r in enumerate([1.0, 0.0, 0.3, 0.7, 0.0])]
    for std_scaling in (False, True):
        base = compute_advantages(samples, AdvantageConfig(std_scaling=std_scaling))
        off = compute_advantages(
            samples, AdvantageConfig(std_scaling=std_scaling), process_rewards=[1.0, -1.0, 0.5, None, 0.2]
        )
        assert [s.advantage for s in off] == [s.advantage for s in base]
        assert all("process_reward" not in s.metrics for s in off)


def test_process_reward_of_any_action_matches_the_step_labels() -> None:
    a, b, c = (Action(message=m) for m in ("5", "6", "7"))
    keys = [a.key, a.key, b.key]
    # shares: a 2/3, b 1/3
    assert process_reward(a.key, keys) == pytest.approx(1 / 3)
    assert process_reward(b.key, keys) == pytest.approx(-1 / 3)
    assert process_reward(c.key, keys) == pytest.approx(-2 / 3)
    assert process_reward(a.key, []) == 0.0
    votes = [Vote("t1", a), Vote("t2", a), Vote("t3", b), Vote("t4", None)]
    for trace_action in (a, b, c):  # the trace's own label gives the same number
        label = label_step(trace_action, votes, PairConfig())
        assert process_reward(trace_action.key, keys) == pytest.approx(label.process_reward)


def label(store: TeacherStore, question: str, trace_answer: str, votes: list[str | None]) -> None:
    """Store a labeled step at the state of ``question`` with these teacher answers."""
    record = episode_trace([rollout(question, trace_answer, 0.0)])
    trace = parse_trace(record, "test", TraceSourceConfig())
    store.add_trace(trace)
    store.save_plan(trace.trace_id, [PlannedStep(1, trace.state_hash(1), {}, 1.0, 0.0, True)])
    records = [
        {"teacher": f"t{i}", "outcome": "ok", "action": Action(message=v).key if v else None}
        for i, v in enumerate(votes)
    ]
    valid = [v for v in votes if v is not None]
    store.finish_step(
        trace.trace_id, 1, status="done", outcome="pair", process_reward=0.0,
        trace_share=valid.count(trace_answer) / len(valid) if valid else None, best_share=None,
        num_votes=len(valid), votes=records, cost_usd=0.0, pair=None,
    )  # fmt: skip


def test_lookup_scores_each_rollout_by_the_votes_at_its_state(tmp_path: Path) -> None:
    path = tmp_path / "teacher.sqlite"
    store = TeacherStore(path)
    label(store, "What is 2 + 3?", "6", ["5", "5", "6", None])
    # The same state labeled again by the cascade with one vote: the lookup uses the fuller one.
    label(store, "What is 2 + 3?", "5", ["5"])
    label(store, "What is 1 + 1?", "3", [None])  # no valid vote: not a label
    teacher = TeacherClient(path)
    lookup = ProcessRewards(teacher)
    samples = [
        rollout("What is 2 + 3?", "5", 1.0),
        rollout("What is 2 + 3?", " 6 ", 0.0),  # the same action as "6" once canonical
        rollout("What is 2 + 3?", "7", 0.0),
        rollout("What is 1 + 1?", "2", 1.0),
        rollout("What is 4 + 4?", "8", 1.0),
    ]
    found = lookup.lookup(samples)
    assert [r.mean if r else None for r in found] == pytest.approx([1 / 3, -1 / 3, -2 / 3, None, None])
    assert lookup.metrics() == {"replay/shaping_looked_up": 5, "replay/shaping_shaped": 3}
    teacher.store.close()
    # The agreement rate: 1 of 3 votes for the first trace's "6", 1 of 1 for the second's "5".
    assert store.stats()["votes"] == {"for_trace": 2, "total": 4}
    assert _summary(store.stats())["teacher/agreement_rate"] == 0.5
    store.close()


def test_shaping_needs_the_teacher_store() -> None:
    with pytest.raises(ConfigError, match=r"orchestrator\.advantage\.process_reward_weight = 0\.1 needs"):
        resolve_rl_config(["--orchestrator.advantage.process-reward-weight", "0.1"])

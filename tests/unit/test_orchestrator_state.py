"""The orchestrator's resumable data position: seeded orders, env ratios, checkpoint round trip."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from prime_composer.checkpoint_layout import is_complete, latest_complete_step, part_is_written
from prime_composer.orchestrator.state import OrchestratorState, choose_env, task_index


def test_every_task_once_per_epoch_and_epochs_differ() -> None:
    num_tasks = 13
    epoch0 = [task_index(7, 0, d, num_tasks) for d in range(num_tasks)]
    epoch1 = [task_index(7, 0, d, num_tasks) for d in range(num_tasks, 2 * num_tasks)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(num_tasks))
    assert epoch0 != epoch1  # reshuffled each epoch
    # Reproducible: the same seed gives the same order, another seed another one.
    assert epoch0 == [task_index(7, 0, d, num_tasks) for d in range(num_tasks)]
    assert epoch0 != [task_index(8, 0, d, num_tasks) for d in range(num_tasks)]


def test_env_choice_follows_ratios() -> None:
    counts = Counter(choose_env(0, g, [3.0, 1.0]) for g in range(4000))
    assert abs(counts[0] / 4000 - 0.75) < 0.03
    assert all(choose_env(0, g, [1.0]) == 0 for g in range(10))


def test_state_round_trip_marks_the_part_complete(tmp_path: Path) -> None:
    state = OrchestratorState(step=5, groups_drawn=40, env_draws=[30, 10])
    state.save(tmp_path, keep=2)
    assert part_is_written(tmp_path, 5, "orchestrator")
    # The step is not complete (nor resumable) until the trainer's part is there too.
    assert not is_complete(tmp_path, 5, ("orchestrator",))
    assert latest_complete_step(tmp_path, ("orchestrator",)) is None
    assert OrchestratorState.load(tmp_path, 5) == state

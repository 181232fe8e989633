"""The rollout stream: draw-order batches whatever the timing, the asynchrony and in-flight bounds,
replacement of unusable groups, and a checkpoint position that resumes exactly.

Groups are played by a fake ``run_group`` (sleeps, then returns samples whose rewards are a pure
function of the group id) and weights by a fake ``PolicySync`` that the test publishes to, as
the trainer would after each step.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from prime_composer.config.orchestrator import OrchestratorConfig
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.state import OrchestratorState
from prime_composer.orchestrator.stream import RolloutStream

GROUP = 2


class FakePolicy:
    """Weights version the 'server' runs; the test publishes newer ones."""

    def __init__(self) -> None:
        self.published = 0
        self.loaded_step = 0
        self.load_calls = 0

    async def load_newest(self) -> int:
        if self.published > self.loaded_step:
            self.loaded_step = self.published
            self.load_calls += 1
        return self.loaded_step

    async def ensure(self, min_step: int) -> int:
        while await self.load_newest() < min_step:
            await asyncio.sleep(0.001)
        return self.loaded_step


def rewards_of(group_id: int, dead: set[int], flat: set[int]) -> list[float]:
    if group_id in flat:
        return [1.0] * GROUP  # all equal: dropped under dynamic sampling
    return [float((group_id + i) % 2) for i in range(GROUP)]


class Player:
    """Plays groups: records launches and concurrency, sleeps a per-group time."""

    def __init__(self, delays: dict[int, float] | None = None, dead=(), flat=()) -> None:
        self.delays = delays or {}
        self.dead, self.flat = set(dead), set(flat)
        self.launched: list[tuple[int, int]] = []  # (group id, policy step)
        self.running = 0
        self.max_running = 0

    async def __call__(self, group_id: int, policy_step: int) -> list[Sample]:
        self.launched.append((group_id, policy_step))
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await asyncio.sleep(self.delays.get(group_id, 0.0))
        finally:
            self.running -= 1
        return [
            Sample(
                prompt_ids=[1],
                completion_ids=[2],
                completion_logprobs=[-0.1],
                completion_mask=[1],
                reward=r,
                example_id=group_id,
                group_id=group_id,
                policy_step=policy_step,
                error="boom" if group_id in self.dead else None,
            )
            for r in rewards_of(group_id, self.dead, self.flat)
        ]


def config(**overrides) -> OrchestratorConfig:
    base = {"batch_size": 3 * GROUP, "group_size": GROUP, "max_steps": 6, "weights_poll_s": 0.005}
    return OrchestratorConfig(**{**base, **overrides})


def drawer(state: OrchestratorState):
    def draw() -> int:
        gid = state.groups_drawn
        state.groups_drawn += 1
        state.env_draws[0] += 1
        return gid

    return draw


async def run(cfg: OrchestratorConfig, player: Player, state: OrchestratorState | None = None, steps=None):
    """Consume ``steps`` steps like the loop does, publishing weights s+1 after each step s."""
    state = state or OrchestratorState(env_draws=[0])
    policy = FakePolicy()
    policy.published = policy.loaded_step = state.step  # a resumed run starts on its weights
    batches, checkpoints = [], []
    async with RolloutStream(cfg, state, drawer(state), player, policy) as stream:  # type: ignore[arg-type]
        for _ in range(steps if steps is not None else cfg.max_steps - state.step):
            checkpoints.append(stream.checkpoint_state())
            rollouts = await stream.next_step()
            batches.append(rollouts)
            await asyncio.sleep(0.01)  # the trainer trains...
            policy.published = stream.step  # ...and publishes the weights of the next step
    return batches, checkpoints


def ids(batch) -> list[int]:
    return sorted({s.group_id for s in batch.kept})


def test_batches_follow_draw_order_whatever_the_timing() -> None:
    rng = random.Random(0)
    cfg = config(max_async_level=2)
    straight, _ = asyncio.run(run(cfg, Player()))
    shuffled, _ = asyncio.run(run(cfg, Player({g: rng.uniform(0, 0.03) for g in range(40)})))
    assert [ids(b) for b in straight] == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7, 8],
        [9, 10, 11],
        [12, 13, 14],
        [15, 16, 17],
    ]
    assert [ids(b) for b in shuffled] == [ids(b) for b in straight]
    assert [[s.advantage for s in b.kept] for b in shuffled] == [
        [s.advantage for s in b.kept] for b in straight
    ]


def test_on_policy_nothing_starts_before_its_weights() -> None:
    player = Player({g: 0.005 for g in range(40)})
    batches, _ = asyncio.run(run(config(max_async_level=0), player))
    for step, batch in enumerate(batches):
        assert batch.policy_steps == [step] * 3
    # Every group of step s was launched with weights s: no group ran ahead.
    assert [p for _, p in player.launched] == [g // 3 for g, _ in player.launched]
    assert len(player.launched) == 18  # and none wasted


def test_async_overlaps_the_next_step_with_the_slowest_group() -> None:
    # Group 2 (step 0's last) is slow; with max_async_level 1, step 1's groups start meanwhile.
    player = Player({2: 0.1})
    batches, _ = asyncio.run(run(config(max_async_level=1, max_steps=2), player))
    order = [g for g, _ in player.launched]
    assert order.index(3) < len(order) and {3, 4, 5} <= set(order)
    # Groups 3-5 were launched with weights 0 (before step 0 was consumed): a policy lag of 1.
    assert batches[1].policy_steps == [0, 0, 0]


def test_in_flight_rollouts_are_bounded() -> None:
    player = Player({g: 0.01 for g in range(60)})
    asyncio.run(run(config(max_async_level=3, max_inflight=2 * GROUP), player))
    assert player.max_running <= 2


def test_unusable_groups_are_counted_and_replaced() -> None:
    player = Player(dead={1}, flat={2, 4})
    batches, _ = asyncio.run(run(config(max_async_level=0, max_steps=2), player))
    first = batches[0]
    assert ids(first) == [0, 3, 5]  # 1 failed, 2 and 4 all-equal: replaced by the next ids
    assert (first.num_errors, first.num_zero_variance_groups, first.num_groups) == (GROUP, 2, 6)
    assert ids(batches[1]) == [6, 7, 8]


def test_the_refill_budget_caps_what_a_step_consumes() -> None:
    player = Player(flat=set(range(0, 100, 2)) | {1, 3})
    batches, _ = asyncio.run(run(config(max_async_level=0, max_steps=1, max_refill_rounds=1), player))
    assert batches[0].num_groups == 6  # (1 + 1) x 3 groups consumed, then it trains on what it has
    assert ids(batches[0]) == [5]


def test_too_stale_groups_are_dropped() -> None:
    # max_async_level 3 lets step 1's groups start on weights 0, but max_off_policy_steps 0 only
    # trains on groups of the batch's own step: they are dropped at step 1 and replaced.
    player = Player({g: 0.01 for g in range(12)})
    cfg = config(max_async_level=3, max_off_policy_steps=0, max_steps=2)
    batches, _ = asyncio.run(run(cfg, player))
    assert batches[0].num_off_policy == 0 and batches[0].policy_steps == [0, 0, 0]
    assert batches[1].num_off_policy == 3 * GROUP
    assert batches[1].policy_steps == [1, 1, 1]


def test_checkpoint_position_resumes_exactly() -> None:
    cfg = config(max_async_level=2)
    rng = random.Random(1)
    delays = {g: rng.uniform(0, 0.02) for g in range(60)}
    flat = {4, 9}
    straight, checkpoints = asyncio.run(run(cfg, Player(delays, flat=flat)))
    # "Crash" after step 3 with groups of later steps in flight; resume from the checkpoint of 3.
    saved = checkpoints[3]
    assert saved.step == 3 and saved.groups_drawn == sum(b.num_groups for b in straight[:3])
    resumed, _ = asyncio.run(run(cfg, Player(delays, flat=flat), OrchestratorState(**vars(saved))))
    assert [ids(b) for b in resumed] == [ids(b) for b in straight[3:]]


def test_a_failing_player_fails_the_step_loudly() -> None:
    async def broken(group_id: int, policy_step: int) -> list[Sample]:
        raise RuntimeError("the environment server is gone")

    async def main() -> None:
        state = OrchestratorState(env_draws=[0])
        async with RolloutStream(config(), state, drawer(state), broken, FakePolicy()) as stream:  # type: ignore[arg-type]
            await stream.next_step()

    with pytest.raises(RuntimeError, match="environment server is gone"):
        asyncio.run(main())


def test_max_inflight_must_hold_a_group() -> None:
    with pytest.raises(ValueError, match="max_inflight"):
        OrchestratorConfig(group_size=8, batch_size=16, max_inflight=4)


def test_on_policy_a_step_that_runs_out_of_replacements_leaves_nothing_for_the_next() -> None:
    """Every group of step 0 is unusable: it consumes its budget, and no group drawn for it spills
    into step 1 with step 0's weights, whatever the timing (the draws of step 1 stay the same)."""
    rng = random.Random(3)
    flat = set(range(6))  # (1 + 1) x 3 groups: all of step 0's budget is unusable
    runs = []
    for _ in range(3):
        delays = {g: rng.uniform(0, 0.02) for g in range(40)}
        player = Player(delays, flat=flat)
        batches, _ = asyncio.run(run(config(max_async_level=0, max_steps=2, max_refill_rounds=1), player))
        assert batches[0].num_groups == 6 and batches[0].kept == []
        assert batches[1].policy_steps == [1, 1, 1]  # nothing from step 0's weights
        runs.append([ids(b) for b in batches])
        assert all(policy == g // 6 or g >= 6 for g, policy in player.launched)
    assert runs[0] == runs[1] == runs[2] == [[], [6, 7, 8]]

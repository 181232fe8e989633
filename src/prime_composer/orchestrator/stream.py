"""Streaming rollouts: groups for step s+1 start while step s's slowest groups finish.

``RolloutStream`` launches groups in the background and hands the loop one step's groups at a
time (``next_step``):

- **Draws** are counters (``state.py``): group ``g``'s task and seeds are a pure function of the
  seed, ``g`` and the environments' draw counts, so the data position checkpoints as a few
  integers (``checkpoint_state``: the position after the last *consumed* group; groups still in
  flight are drawn again on resume).
- **Launching** is bounded three ways: at most ``max_inflight`` rollouts launched and not finished;
  the asynchrony bound, under which a group started with the weights of step ``w`` is meant for a
  batch ``<= w + max_async_level`` (at ``max_async_level = 0`` step s's groups all start after the
  weights of step s are loaded, and nothing overlaps); and ``max_steps``. A group still in flight
  counts as usable until it finishes.
- **Consumption is in draw order**: batch s takes the first ``num_groups`` usable groups after the
  ones batch s-1 took, whatever order they finish in. A group is unusable when every rollout
  failed, when its rewards are all equal under dynamic sampling, or when its weights are more
  than ``max_off_policy_steps`` behind the batch; unusable groups are counted and replaced. A step
  consumes at most ``(1 + max_refill_rounds) x num_groups`` groups and then trains on what it has;
  when only the current step may be sampled for (on-policy), no group beyond that budget is
  launched, so none spills into the next step. In draw order the batches do not depend on timing,
  so an on-policy run is exact and resumes exactly.

The stream also keeps the inference server on the newest published weights: before launching it
loads newer weights when the trainer has published some (``PolicySync.load_newest``), and when
the asynchrony bound allows nothing more it waits for them (``PolicySync.ensure``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from prime_composer.config.errors import RunError
from prime_composer.config.orchestrator import FailureConfig, OrchestratorConfig
from prime_composer.orchestrator.advantages import compute_advantages, filter_zero_variance
from prime_composer.orchestrator.policy import PolicySync
from prime_composer.orchestrator.sample import ProcessReward, Sample
from prime_composer.orchestrator.state import OrchestratorState

logger = logging.getLogger(__name__)

RunGroup = Callable[[int, int], Coroutine[Any, Any, list[Sample]]]
"""``(group id, policy step) -> samples``: plays a group the stream drew to its end."""


@dataclass
class FinishedGroup:
    """A group whose rollouts all ended, waiting to be consumed in draw order."""

    group_id: int
    policy_step: int
    samples: list[Sample]
    """Every sample of the group, failed ones included."""
    ok: list[Sample]
    """The samples without an error."""
    scored: list[Sample] | None
    """The ok samples with advantages; None when the group cannot be trained on at any step (all
    failed, or all rewards equal under dynamic sampling)."""


@dataclass
class StepRollouts:
    """What one step's consumption produced, kept and not."""

    kept: list[Sample] = field(default_factory=list)
    generated: list[Sample] = field(default_factory=list)
    """Every sample of the groups consumed this step (kept or dropped), failed ones excluded."""
    num_errors: int = 0
    num_zero_variance_groups: int = 0
    num_off_policy: int = 0
    """Samples dropped for weights older than ``max_off_policy_steps``."""
    num_groups: int = 0
    """Groups consumed this step, kept and dropped."""
    policy_steps: list[int] = field(default_factory=list)
    """Weights version of each kept group."""
    error_examples: list[str] = field(default_factory=list)
    """The first few errors of the step's failed rollouts (for the message of a failed run)."""


class RolloutStream:
    """Launches groups in the background and returns each step's groups in draw order.

    Use as ``async with RolloutStream(...) as stream: rollouts = await stream.next_step()``.
    """

    def __init__(
        self,
        config: OrchestratorConfig,
        drawn: OrchestratorState,
        draw: Callable[[], int],
        run_group: RunGroup,
        policy: PolicySync,
        process_rewards: Callable[[list[Sample]], Sequence[float | ProcessReward | None]] | None = None,
    ) -> None:
        """``drawn`` is the draw position ``draw()`` advances (it returns the next group id); at
        construction it is also the consumed position (a fresh run or a resumed checkpoint).
        ``process_rewards`` gives each finished rollout of a group its teachers' process reward
        (``replay/shaping.py``) for ``compute_advantages``; None: no shaping."""
        self.config = config
        self.process_rewards = process_rewards
        self.drawn = drawn
        self.draw = draw
        self.run_group = run_group
        self.policy = policy
        self.num_groups = config.batch_size // config.group_size
        self.max_inflight = config.max_inflight or config.batch_size * (config.max_async_level + 1)
        self.max_consumed = (1 + config.max_refill_rounds) * self.num_groups
        """Groups one step may consume (kept or dropped) before it trains on what it has."""
        self.step = drawn.step
        """The step whose batch is being formed (or next to be)."""
        self._consumed = OrchestratorState(drawn.step, drawn.groups_drawn, list(drawn.env_draws))
        self._next_id = drawn.groups_drawn
        self._step_start = drawn.groups_drawn
        """Id of the first group of the step being formed."""
        self._draws_after: dict[int, list[int]] = {}
        """Environment draw counts after each drawn, unconsumed group."""
        self._pending: dict[int, asyncio.Task[list[Sample]]] = {}
        self._policy_of: dict[int, int] = {}
        self._finished: dict[int, FinishedGroup] = {}
        self._usable_ahead = 0
        """Unconsumed groups that may still be used: in flight, or finished and scored."""
        self._kept_now = 0
        """Groups kept so far for the step being formed."""
        self._wake = asyncio.Event()
        self._error: BaseException | None = None
        self._pump_task: asyncio.Task[None] | None = None
        self.wait_weights_s = 0.0
        """Time the stream spent waiting for weights, since the last ``next_step`` returned."""

    async def __aenter__(self) -> RolloutStream:
        self._pump_task = asyncio.create_task(self._pump(), name="rollout-stream")
        return self

    async def __aexit__(self, *exc: object) -> None:
        tasks = [t for t in (self._pump_task, *self._pending.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def checkpoint_state(self) -> OrchestratorState:
        """The data position after the last consumed group, for the checkpoint of ``self.step``."""
        return OrchestratorState(self.step, self._consumed.groups_drawn, list(self._consumed.env_draws))

    # -------------------------------------------------------------------------------- consuming

    async def next_step(self) -> StepRollouts:
        """Wait for the current step's groups, consume them in draw order, and move to the next step."""
        out = StepRollouts()
        kept: list[list[Sample]] = []
        while len(kept) < self.num_groups and out.num_groups < self.max_consumed:
            group = self._finished.pop(self._next_id, None)
            if group is None:
                await self._wait()
                continue
            if self._consume(group, out):
                kept.append(group.scored)  # type: ignore[arg-type]  # scored when consumed as usable
                out.policy_steps.append(group.policy_step)
                self._kept_now += 1
        if len(kept) < self.num_groups:
            logger.warning(
                "step %d: only %d of %d groups usable among %d consumed (raise orchestrator.max_refill_rounds "
                "to replace more)",
                self.step,
                len(kept),
                self.num_groups,
                out.num_groups,
            )
        for group_samples in kept:
            out.kept.extend(group_samples)
        self.step += 1
        self._kept_now = 0
        self._step_start = self._next_id
        self._wake.set()
        return out

    def _consume(self, group: FinishedGroup, out: StepRollouts) -> bool:
        """Account for ``group`` in ``out``; True when this step can train on it."""
        gid = group.group_id
        self._next_id = gid + 1
        self._consumed.groups_drawn = gid + 1
        self._consumed.env_draws = self._draws_after.pop(gid)
        out.num_groups += 1
        out.num_errors += len(group.samples) - len(group.ok)
        out.generated.extend(group.ok)
        for sample in group.samples:
            if sample.error is not None and len(out.error_examples) < 3:
                out.error_examples.append(sample.error)
        if group.scored is None:
            if group.ok and self.config.advantage.dynamic_sampling:
                out.num_zero_variance_groups += 1
            return False
        self._usable_ahead -= 1
        if self.step - group.policy_step > self.config.max_off_policy_steps:
            out.num_off_policy += len(group.ok)
            self._wake.set()  # a replacement is needed
            return False
        return True

    async def _wait(self) -> None:
        self._raise_if_failed()
        await self._sleep()
        self._raise_if_failed()

    async def _sleep(self) -> None:
        """Until something changes (a group finished, a step was consumed) or one poll interval.

        ``asyncio.timeout``, not ``wait_for``: in Python 3.11 ``wait_for`` can swallow a
        cancellation that arrives as the event fires, and the stream would then never stop."""
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.weights_poll_s):
                await self._wake.wait()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    # -------------------------------------------------------------------------------- launching

    def _demand(self) -> int:
        """Usable groups the asynchrony bound allows to exist now, beyond those kept this step."""
        last_allowed = min(self.policy.loaded_step + self.config.max_async_level, self.config.max_steps - 1)
        return max(0, (last_allowed + 1 - self.step) * self.num_groups - self._kept_now)

    def _may_launch(self) -> bool:
        in_flight = len(self._pending) * self.config.group_size
        if in_flight + self.config.group_size > self.max_inflight or self._usable_ahead >= self._demand():
            return False
        # When only this step may be sampled for and it cannot consume more, a group drawn now would
        # land in the next step with older weights, and how many such groups there are would depend
        # on timing (an on-policy run would no longer be exact).
        only_this_step = self.policy.loaded_step + self.config.max_async_level <= self.step
        return not (only_this_step and self.drawn.groups_drawn >= self._step_start + self.max_consumed)

    async def _pump(self) -> None:
        try:
            while True:
                await self.policy.load_newest()
                if self.step < self.config.max_steps and self._demand() == 0 and self._usable_ahead == 0:
                    # Nothing may start until newer weights arrive.
                    started = time.monotonic()
                    await self.policy.ensure(self.step - self.config.max_async_level)
                    self.wait_weights_s += time.monotonic() - started
                    continue
                while self._may_launch():
                    self._launch()
                await self._sleep()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # surfaced by next_step(): the loop fails loudly
            self._error = e
            self._wake.set()

    def _launch(self) -> None:
        gid = self.draw()
        self._draws_after[gid] = list(self.drawn.env_draws)
        policy_step = self.policy.loaded_step
        self._policy_of[gid] = policy_step
        self._usable_ahead += 1
        task = asyncio.create_task(self.run_group(gid, policy_step), name=f"group-{gid}")
        self._pending[gid] = task
        task.add_done_callback(functools.partial(self._on_done, gid))

    def _on_done(self, gid: int, task: asyncio.Task[list[Sample]]) -> None:
        del self._pending[gid]
        if task.cancelled():
            return
        if (error := task.exception()) is not None:
            self._error = error
            self._wake.set()
            return
        samples = task.result()
        for sample in samples:
            if sample.error is None and not math.isfinite(sample.reward):
                sample.error = f"the environment returned a non-finite reward ({sample.reward})"
        ok = [s for s in samples if s.error is None]
        scored: list[Sample] | None = None
        if ok:
            shaping = self.process_rewards(ok) if self.process_rewards is not None else None
            scored = compute_advantages(
                ok, self.config.advantage, max_tokens=self.config.sampling.max_tokens, process_rewards=shaping
            )
            if self.config.advantage.dynamic_sampling:
                scored = filter_zero_variance(scored)[0] or None
        if scored is None:
            self._usable_ahead -= 1
        self._finished[gid] = FinishedGroup(gid, self._policy_of.pop(gid), samples, ok, scored)
        self._wake.set()


class FailureWatch:
    """Stops a run (``RunError``) whose rollouts fail or that has nothing to train on, instead of
    letting it report success having learned nothing (``orchestrator.failure``)."""

    def __init__(self, cfg: FailureConfig) -> None:
        self.cfg = cfg
        self.num_empty_steps = 0

    def check(self, step: int, rollouts: StepRollouts) -> None:
        cfg = self.cfg
        total = rollouts.num_errors + len(rollouts.generated)
        if total and rollouts.num_errors / total >= cfg.max_error_fraction:
            raise RunError(
                f"step {step}: {rollouts.num_errors} of {total} rollouts failed "
                f"(orchestrator.failure.max_error_fraction = {cfg.max_error_fraction}); e.g. "
                + " | ".join(rollouts.error_examples)
            )
        self.num_empty_steps = 0 if rollouts.kept else self.num_empty_steps + 1
        if self.num_empty_steps >= cfg.max_empty_steps:
            raise RunError(
                f"no sample to train on for {self.num_empty_steps} steps in a row (step {step}: "
                f"{rollouts.num_zero_variance_groups} groups with equal rewards, {rollouts.num_errors} failed "
                f"rollouts, {rollouts.num_off_policy} too stale samples): check the environment's reward, the "
                "sampling temperature and group_size (orchestrator.failure.max_empty_steps sets how many such "
                "steps stop the run)"
            )

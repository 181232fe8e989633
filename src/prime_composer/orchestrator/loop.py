"""The orchestrator's main loop: one packed batch per training step.

For step ``s``:

1. **weights**: the server must run weights of step ``>= s - max_async_level``; wait for the
   trainer to publish them and load the newest (``PolicySync``);
2. **eval**: every ``eval.interval`` steps, the held-out split of each environment;
3. **rollouts**: ``batch_size / group_size`` groups, each ``group_size`` rollouts of one task;
   failed rollouts are counted and left out; advantages per group; with dynamic sampling, groups
   whose rewards are all equal are replaced by fresh groups (at most ``max_refill_rounds``
   rounds); samples from weights older than ``max_off_policy_steps`` are dropped;
4. **SDPO hints** (``orchestrator.sdpo.enabled``): failed rollouts get a hinted teacher context
   (``hints.py``), packed next to their students;
5. **pack and send** micro-batches for every trainer rank;
6. **log** ``metrics/orchestrator.jsonl`` and checkpoint the data position.

It never imports trainer or model code: it talks to the server over HTTP and to the trainer
through ``transport``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from statistics import fmean, pstdev
from typing import Any

from prime_composer.checkpoint_layout import resume_step
from prime_composer.config.env import SamplingConfig
from prime_composer.config.orchestrator import OrchestratorConfig
from prime_composer.metrics import MetricsLogger
from prime_composer.orchestrator.advantages import compute_advantages, filter_zero_variance
from prime_composer.orchestrator.envs import LoadedEnv
from prime_composer.orchestrator.packing import GroupPacker, pack_step
from prime_composer.orchestrator.policy import PolicySync
from prime_composer.orchestrator.rollout import RolloutRunner
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.sdpo.hints import HintBuilder
from prime_composer.orchestrator.sdpo.packing import SDPOPacker
from prime_composer.orchestrator.state import OrchestratorState, choose_env, task_index
from prime_composer.transport.factory import make_sender

logger = logging.getLogger(__name__)


@dataclass
class StepRollouts:
    """What one step's rollout stage produced, kept and not."""

    kept: list[Sample] = field(default_factory=list)
    generated: list[Sample] = field(default_factory=list)
    """Every sample generated this step (for reward statistics), failed ones excluded."""
    num_errors: int = 0
    num_zero_variance_groups: int = 0
    num_off_policy: int = 0
    num_rounds: int = 0


class Orchestrator:
    def __init__(
        self,
        config: OrchestratorConfig,
        envs: list[LoadedEnv],
        pad_token_id: int,
        hints: HintBuilder | None = None,
    ) -> None:
        """``hints`` builds SDPO targets each step (``orchestrator.sdpo.enabled``); None = off."""
        if config.batch_size % config.group_size:
            raise ValueError(
                f"orchestrator.batch_size ({config.batch_size}) must be a multiple of "
                f"orchestrator.group_size ({config.group_size})"
            )
        self.config = config
        self.envs = envs
        self.pad_token_id = pad_token_id
        if config.sdpo.enabled and hints is None:
            raise ValueError("orchestrator.sdpo.enabled needs a HintBuilder (orchestrator/main.py makes one)")
        self.hints = hints
        self.packers: list[GroupPacker] = [SDPOPacker()] if hints is not None else []
        self.num_groups = config.batch_size // config.group_size
        self.ckpt_root = config.output_dir / "checkpoints"
        self.state = OrchestratorState(env_draws=[0] * len(envs))
        self.train_tasks = [loaded.tasks("train") for loaded in envs]
        for loaded, tasks in zip(envs, self.train_tasks, strict=True):
            if not tasks:
                raise ValueError(f"orchestrator.env[{loaded.index}] (id={loaded.config.id!r}) has no tasks")
        self.metrics = MetricsLogger(config.output_dir, "orchestrator")

    # --------------------------------------------------------------------------------- the loop

    async def run(self) -> None:
        config = self.config
        if config.ckpt.resume or config.ckpt.resume_step is not None:
            step = resume_step(self.ckpt_root, config.ckpt.resume_step, config.ckpt.parts)
            self.state = OrchestratorState.load(self.ckpt_root, step)
            logger.info("resumed at step %d (%d groups drawn)", step, self.state.groups_drawn)
        policy = PolicySync(
            config.output_dir / "broadcasts",
            config.base_url,
            secret_env=config.inference_secret_env,
            poll_s=config.weights_poll_s,
            timeout_s=config.weights_timeout_s,
        )
        sender = make_sender(config.transport, config.output_dir)
        eval_sampling = config.sampling.model_copy(update={"temperature": config.eval.temperature})
        try:
            async with RolloutRunner(
                self.envs,
                base_url=config.base_url,
                model=config.model.name,
                sampling=config.sampling,
                rollout=config.rollout,
            ) as runner:
                while self.state.step < config.max_steps:
                    step = self.state.step
                    if (
                        config.ckpt.interval
                        and step % config.ckpt.interval == 0
                        and not self._resumed_at(step)
                    ):
                        self.state.save(self.ckpt_root, config.ckpt.keep)
                    metrics: dict[str, Any] = {}
                    t0 = time.monotonic()
                    policy_step = await policy.ensure(step - config.max_async_level)
                    metrics["time/wait_weights_s"] = time.monotonic() - t0
                    if self._eval_due(step):
                        metrics.update(await self.evaluate(runner, eval_sampling, policy_step))
                    t0 = time.monotonic()
                    rollouts = await self.collect(runner, step, policy_step)
                    metrics["time/rollout_s"] = time.monotonic() - t0
                    if self.hints is not None:
                        t0 = time.monotonic()
                        hint_stats = await self.hints.apply(rollouts.kept)
                        metrics.update(hint_stats.metrics(config.sdpo.sources))
                        metrics["time/hints_s"] = time.monotonic() - t0
                    rank_batches, stats = pack_step(
                        rollouts.kept,
                        config.seq_len,
                        config.micro_batch_size,
                        config.num_train_ranks,
                        self.pad_token_id,
                        temperature=config.sampling.temperature,
                        packers=self.packers,
                    )
                    sender.send(step, rank_batches)
                    metrics.update(self._step_metrics(step, policy_step, rollouts))
                    metrics.update(stats.metrics())
                    self.metrics.log(step, metrics)
                    logger.info(
                        "step %d: reward %.3f, %d samples, policy lag %d",
                        step,
                        metrics.get("reward/mean", float("nan")),
                        len(rollouts.kept),
                        step - policy_step,
                    )
                    self.state.step += 1
                final = self.state.step
                if config.ckpt.at_end:
                    self.state.save(self.ckpt_root, config.ckpt.keep)
                if config.eval.interval and self._has_eval():
                    # The last batch's weights are published after the trainer's final step.
                    policy_step = await policy.ensure(final)
                    self.metrics.log(final, await self.evaluate(runner, eval_sampling, policy_step))
        finally:
            sender.close()

    def _resumed_at(self, step: int) -> bool:
        """The checkpoint of the step we resumed from already exists: don't rewrite it."""
        return (self.ckpt_root / f"step_{step}" / "orchestrator.STABLE").exists()

    def _has_eval(self) -> bool:
        return any(loaded.eval_taskset is not None for loaded in self.envs)

    def _eval_due(self, step: int) -> bool:
        interval = self.config.eval.interval
        if not interval or not self._has_eval():
            return False
        return (step == 0 and self.config.eval.at_start) or (step > 0 and step % interval == 0)

    # ------------------------------------------------------------------------------ rollouts

    def _draw_group(self) -> tuple[LoadedEnv, int, int]:
        """(environment, task index, group id) of the next group, advancing the state."""
        group_id = self.state.groups_drawn
        env_i = choose_env(self.config.seed, group_id, [e.config.ratio for e in self.envs])
        draw = self.state.env_draws[env_i]
        index = task_index(self.config.seed, env_i, draw, len(self.train_tasks[env_i]))
        self.state.groups_drawn += 1
        self.state.env_draws[env_i] += 1
        return self.envs[env_i], index, group_id

    async def collect(self, runner: RolloutRunner, step: int, policy_step: int) -> StepRollouts:
        config = self.config
        out = StepRollouts()
        groups: list[list[Sample]] = []
        missing = self.num_groups
        while missing > 0 and out.num_rounds <= config.max_refill_rounds:
            out.num_rounds += 1
            draws = [self._draw_group() for _ in range(missing)]
            results = await asyncio.gather(
                *(
                    runner.run_group(
                        loaded,
                        self.train_tasks[loaded.index][index],
                        group_size=config.group_size,
                        example_id=index,
                        group_id=group_id,
                        policy_step=policy_step,
                    )
                    for loaded, index, group_id in draws
                )
            )
            for group in results:
                ok = [s for s in group if s.error is None]
                out.num_errors += len(group) - len(ok)
                fresh = [s for s in ok if step - s.policy_step <= config.max_off_policy_steps]
                out.num_off_policy += len(ok) - len(fresh)
                out.generated.extend(ok)
                if not fresh:
                    continue
                scored = compute_advantages(fresh, config.advantage, max_tokens=config.sampling.max_tokens)
                if config.advantage.dynamic_sampling:
                    scored, dropped = filter_zero_variance(scored)
                    out.num_zero_variance_groups += dropped
                    if not scored:
                        continue
                groups.append(scored)
            missing = self.num_groups - len(groups)
            if not config.advantage.dynamic_sampling:
                break
        for group in groups[: self.num_groups]:
            out.kept.extend(group)
        return out

    async def evaluate(
        self, runner: RolloutRunner, sampling: SamplingConfig, policy_step: int
    ) -> dict[str, float]:
        """Mean reward of one rollout per held-out task, per environment and overall."""
        metrics: dict[str, float] = {}
        rewards_all: list[float] = []
        for loaded in self.envs:
            if loaded.eval_taskset is None:
                continue
            tasks = loaded.tasks("eval")
            results = await asyncio.gather(
                *(
                    runner.run_group(
                        loaded,
                        task,
                        group_size=1,
                        example_id=i,
                        group_id=-1 - i,
                        policy_step=policy_step,
                        sampling=sampling,
                    )
                    for i, task in enumerate(tasks)
                )
            )
            rewards = [s.reward for group in results for s in group]
            rewards_all += rewards
            metrics[f"eval/{loaded.label}/accuracy"] = fmean(rewards) if rewards else 0.0
        if rewards_all:
            metrics["eval/accuracy"] = fmean(rewards_all)
        return metrics

    # ------------------------------------------------------------------------------- metrics

    def _step_metrics(self, step: int, policy_step: int, rollouts: StepRollouts) -> dict[str, float]:
        generated = rollouts.generated
        metrics: dict[str, float] = {
            "async/policy_lag": step - policy_step,
            "samples/kept": len(rollouts.kept),
            "samples/generated": len(generated),
            "samples/errors": rollouts.num_errors,
            "samples/off_policy_dropped": rollouts.num_off_policy,
            "groups/zero_variance_dropped": rollouts.num_zero_variance_groups,
            "groups/rounds": rollouts.num_rounds,
        }
        if not generated:
            return metrics
        rewards = [s.reward for s in generated]
        lengths = [len(s.completion_ids) for s in generated]
        metrics.update(
            {
                "reward/mean": fmean(rewards),
                "reward/std": pstdev(rewards),
                "seq/completion_len_mean": fmean(lengths),
                "seq/truncated_fraction": fmean(float(s.is_truncated) for s in generated),
            }
        )
        by_env: dict[str, list[float]] = defaultdict(list)
        extra: dict[str, list[float]] = defaultdict(list)
        for s in generated:
            by_env[s.info.get("env", "env")].append(s.reward)
            for key, value in s.metrics.items():
                extra[key].append(value)
        if len(by_env) > 1:
            metrics.update({f"env/{label}/reward": fmean(r) for label, r in by_env.items()})
        metrics.update({f"env_metric/{key}": fmean(v) for key, v in extra.items()})
        if rollouts.kept:
            metrics["advantage/abs_mean"] = fmean(abs(s.advantage) for s in rollouts.kept)
        return metrics

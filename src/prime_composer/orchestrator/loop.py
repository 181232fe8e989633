"""The orchestrator's main loop: one packed batch per training step, from a stream of rollouts.

Rollouts stream (``stream.py``): groups of ``group_size`` rollouts of one task start in the
background, at most ``max_inflight`` rollouts at a time and within the asynchrony bound, so groups
for step s+1 run while step s's slowest ones finish. For step ``s`` the loop

1. **checkpoints** the data position every ``ckpt.interval`` steps;
2. **evaluates** every ``eval.interval`` steps (the held-out split of each environment);
3. **takes** step s's groups from the stream, in draw order: failed rollouts are counted and left
   out, advantages are per group, groups that cannot be trained on (dynamic sampling, too stale)
   are replaced;
4. **hands** the step to every enabled channel (``channel.py``): each sees the generated rollouts,
   may annotate the kept samples (SDPO's hinted teacher contexts) and bring items of its own
   (replay's pairs);
5. **packs and sends** micro-batches for every trainer rank (the channels' group packers build
   their terms' tensors);
6. **logs** ``metrics/orchestrator.jsonl``.

With several inference replicas (``base_url`` a list) rollouts go through the pool's relay
(``replicas.py``): least in flight among the replicas on the current weights, a replica that fails
taken out and retried; the step's metrics then carry ``replicas/*``.

The loop names no channel: they are built from the registry (``channels/``, ``main.py``) and
passed in. It never imports trainer or model code: it talks to the server over HTTP and to the trainer
through ``transport``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from statistics import fmean, pstdev
from typing import Any

from prime_composer.checkpoint_layout import resume_step
from prime_composer.client.tls import inference_tls
from prime_composer.config.env import SamplingConfig
from prime_composer.config.errors import RunError
from prime_composer.config.orchestrator import OrchestratorConfig
from prime_composer.metrics import MetricsLogger
from prime_composer.orchestrator.channel import OrchestratorChannel
from prime_composer.orchestrator.envs import LoadedEnv
from prime_composer.orchestrator.packing import GroupPacker, pack_step
from prime_composer.orchestrator.policy import PolicySync
from prime_composer.orchestrator.replicas import ReplicaPool, rollout_url
from prime_composer.orchestrator.rollout import API_KEY_VAR, RolloutRunner
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.state import OrchestratorState, choose_env, task_index
from prime_composer.orchestrator.stream import FailureWatch, RolloutStream, RunGroup, StepRollouts
from prime_composer.transport.factory import BatchSender, make_sender
from prime_composer.wire.auth import inference_signer_from_env

logger = logging.getLogger(__name__)


def log_metrics(metrics_logger: MetricsLogger, step: int, metrics: dict[str, Any]) -> None:
    """Append ``metrics`` as the record of ``step`` and, when it holds an eval, log the held-out
    accuracies under the same step (the final eval comes after the last training step, under step
    ``max_steps``), so that the log, the file and the progress line show the same numbers."""
    metrics_logger.log(step, metrics)
    evals = {k: v for k, v in metrics.items() if k.startswith("eval/") and k.endswith("accuracy")}
    if evals:
        logger.info("step %d: held-out %s", step, ", ".join(f"{k}={v:.4g}" for k, v in evals.items()))


class Orchestrator:
    def __init__(
        self,
        config: OrchestratorConfig,
        envs: list[LoadedEnv],
        pad_token_id: int,
        channels: Sequence[OrchestratorChannel] = (),
    ) -> None:
        """``channels``: the enabled channels' orchestrator parts, in registration order
        (``main.py`` builds them from the registry)."""
        self.config = config
        self.envs = envs
        self.pad_token_id = pad_token_id
        self.channels = list(channels)
        names = [c.name for c in self.channels]
        if len(set(names)) != len(names):
            raise ValueError(f"orchestrator channels {names}: a channel is given twice")
        self.packers: list[GroupPacker] = [c.packer for c in self.channels if c.packer is not None]
        if any(p.name != c.name for c in self.channels if (p := c.packer) is not None):
            raise ValueError("a channel's packer must build the group of the channel's name")
        self.num_groups = config.batch_size // config.group_size
        self.ckpt_root = config.output_dir / "checkpoints"
        self.state = OrchestratorState(env_draws=[0] * len(envs))
        """The draw position (ahead of the consumed one while groups are in flight)."""
        self._drawn: dict[int, tuple[LoadedEnv, int]] = {}
        self.failure_watch = FailureWatch(config.failure)
        self.train_tasks = [loaded.tasks("train") for loaded in envs]
        for loaded, tasks in zip(envs, self.train_tasks, strict=True):
            if not tasks:
                raise ValueError(f"orchestrator.env[{loaded.index}] (id={loaded.config.id!r}) has no tasks")
        self.metrics = MetricsLogger(config.output_dir, "orchestrator")
        self.pool = ReplicaPool(
            config.server_urls,
            config.replicas,
            signer=inference_signer_from_env(config.inference_secret_env),
            tls=inference_tls(config.inference_tls_fingerprint, config.inference_tls_ca),
        )
        """The inference servers rollouts and weight updates go to (one, or several replicas)."""

    # --------------------------------------------------------------------------------- the loop

    async def run(self) -> None:
        config = self.config
        if config.ckpt.resume or config.ckpt.resume_step is not None:
            step = resume_step(self.ckpt_root, config.ckpt.resume_step, config.ckpt.parts)
            self.state = OrchestratorState.load(self.ckpt_root, step)
            for channel in self.channels:
                channel.load_state_dict(self.state.sources.get(channel.name, {}))
            logger.info("resumed at step %d (%d groups drawn)", step, self.state.groups_drawn)
        policy = PolicySync(
            config.output_dir / "broadcasts",
            self.pool,
            secret_env=config.inference_secret_env,
            poll_s=config.weights_poll_s,
            timeout_s=config.weights_timeout_s,
            retry=config.weights_load_retry,
        )
        sender = make_sender(config.transport, config.output_dir)
        eval_sampling = config.sampling.model_copy(update={"temperature": config.eval.temperature})
        try:
            for channel in self.channels:
                await channel.open()  # closed in ``finally``, opened or not
            shaping = [c.process_rewards for c in self.channels if c.process_rewards is not None]
            if len(shaping) > 1:
                raise ValueError("more than one channel shapes the rewards (process_rewards)")
            async with (
                self.pool,
                rollout_url(self.pool) as base_url,
                RolloutRunner(
                    self.envs,
                    base_url=base_url,
                    model=config.model.name,
                    sampling=config.sampling,
                    rollout=config.rollout,
                    # With a secret every route of the server needs it, generation included.
                    api_key_var=config.inference_secret_env or API_KEY_VAR,
                ) as runner,
                RolloutStream(
                    config,
                    self.state,
                    self._draw_group,
                    self._group_runner(runner),
                    policy,
                    process_rewards=shaping[0] if shaping else None,
                ) as stream,
            ):
                while stream.step < config.max_steps:
                    await self._step(stream, runner, policy, sender, eval_sampling)
                final = stream.step
                if config.ckpt.at_end:
                    self._save(stream)
                if config.eval.interval and self._has_eval():
                    # The last batch's weights are published after the trainer's final step.
                    policy_step = await policy.ensure(final)
                    log_metrics(self.metrics, final, await self.evaluate(runner, eval_sampling, policy_step))
        finally:
            sender.close()
            await policy.aclose()
            for channel in self.channels:
                await channel.aclose()

    async def _step(
        self,
        stream: RolloutStream,
        runner: RolloutRunner,
        policy: PolicySync,
        sender: BatchSender,
        eval_sampling: SamplingConfig,
    ) -> None:
        config = self.config
        step = stream.step
        if config.ckpt.interval and step % config.ckpt.interval == 0 and not self._resumed_at(step):
            self._save(stream)
        metrics: dict[str, Any] = {}
        if self._eval_due(step):
            policy_step = await policy.ensure(step - config.max_async_level)
            metrics.update(await self.evaluate(runner, eval_sampling, policy_step))
        t0 = time.monotonic()
        rollouts = await stream.next_step()
        metrics["time/rollout_s"] = time.monotonic() - t0
        if rollouts.num_errors and not await self.pool.any_answers():
            # Rollouts that failed because no server answers are not data: a step trained on
            # them (and checkpointed before the launcher stops the run) would make the resumed
            # run differ from one that never crashed.
            raise RunError(
                f"step {step}: {rollouts.num_errors} rollouts failed and no inference server answers "
                f"/health ({', '.join(self.pool.urls)}); the step is not trained. Resume (--resume) "
                "once the server is back"
            )
        self.failure_watch.check(step, rollouts)
        for channel in self.channels:
            metrics.update(channel.observe(rollouts.generated))
        metrics["time/wait_weights_s"], stream.wait_weights_s = stream.wait_weights_s, 0.0
        extras: dict[str, list[Any]] = {}
        t0 = time.monotonic()
        for channel in self.channels:
            items = await channel.take(step, rollouts.kept)
            if items or channel.packer is not None:
                extras[channel.name] = items
            metrics.update(channel.metrics())
        metrics["time/channels_s"] = time.monotonic() - t0  # the channels' take (replay: pairs, reference)
        t0 = time.monotonic()
        rank_batches, stats = pack_step(
            rollouts.kept,
            config.seq_len,
            config.micro_batch_size,
            config.num_train_ranks,
            self.pad_token_id,
            temperature=config.sampling.temperature,
            packers=self.packers,
            extras=extras,
        )
        sender.send(step, rank_batches)
        metrics["time/pack_send_s"] = time.monotonic() - t0
        metrics.update(self._step_metrics(step, rollouts))
        metrics.update(stats.metrics())
        if len(self.pool.replicas) > 1:
            metrics.update(self.pool.metrics())
        log_metrics(self.metrics, step, metrics)
        logger.info(
            "step %d: reward %.4g, %d samples, policy lag %s",
            step,
            metrics.get("reward/mean", float("nan")),
            len(rollouts.kept),
            metrics.get("async/policy_lag", "-"),
        )

    def _save(self, stream: RolloutStream) -> None:
        state = stream.checkpoint_state()
        state.sources = {c.name: part for c in self.channels if (part := c.state_dict())}
        state.save(self.ckpt_root, self.config.ckpt.keep, self.config.ckpt.parts)

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

    def _draw_group(self) -> int:
        """Draw the next group (advancing the draw counters) and return its id."""
        group_id = self.state.groups_drawn
        env_i = choose_env(self.config.seed, group_id, [e.config.ratio for e in self.envs])
        draw = self.state.env_draws[env_i]
        index = task_index(self.config.seed, env_i, draw, len(self.train_tasks[env_i]))
        self.state.groups_drawn += 1
        self.state.env_draws[env_i] += 1
        self._drawn[group_id] = (self.envs[env_i], index)
        return group_id

    def _group_runner(self, runner: RolloutRunner) -> RunGroup:
        async def run_group(group_id: int, policy_step: int) -> list[Sample]:
            loaded, index = self._drawn.pop(group_id)
            return await runner.run_group(
                loaded,
                self.train_tasks[loaded.index][index],
                group_size=self.config.group_size,
                example_id=index,
                group_id=group_id,
                policy_step=policy_step,
            )

        return run_group

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

    def _step_metrics(self, step: int, rollouts: StepRollouts) -> dict[str, float]:
        generated = rollouts.generated
        metrics: dict[str, float] = {
            "samples/kept": len(rollouts.kept),
            "samples/generated": len(generated),
            "samples/errors": rollouts.num_errors,
            "samples/off_policy_dropped": rollouts.num_off_policy,
            "groups/zero_variance_dropped": rollouts.num_zero_variance_groups,
            "groups/consumed": rollouts.num_groups,
        }
        if rollouts.policy_steps:
            lags = [step - p for p in rollouts.policy_steps]
            metrics["async/policy_lag"] = fmean(lags)
            metrics["async/policy_lag_max"] = max(lags)
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
            by_env[s.episode.env].append(s.reward)
            for key, value in s.metrics.items():
                extra[key].append(value)
        if len(by_env) > 1:
            metrics.update({f"env/{label}/reward": fmean(r) for label, r in by_env.items()})
        metrics.update({f"env_metric/{key}": fmean(v) for key, v in extra.items()})
        if rollouts.kept:
            metrics["advantage/abs_mean"] = fmean(abs(s.advantage) for s in rollouts.kept)
        return metrics

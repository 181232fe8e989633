"""The RL trainer loop: receive a step's micro-batches, take one optimizer step, publish weights.

For step ``s`` (model = policy after ``s`` optimizer steps):

1. checkpoint every ``ckpt.interval`` steps (the state *before* step ``s``, as the orchestrator's
   part of the same checkpoint);
2. receive this rank's micro-batches of step ``s`` (the trainer never samples: the orchestrator
   decides what to learn from);
3. forward/backward each micro-batch over the enabled loss terms (``step.py``), each normalised
   by its own *global* count, so the gradient does not depend on how samples were split;
4. clip, and skip the update if the loss or grad norm is not finite (``optim.optimizer_step``:
   logged, never silent);
5. publish the new weights as ``broadcasts/step_<s+1>/`` for the inference server (with
   ``[trainer.model.lora]``, the adapter only: ``trainer/lora.py``);
6. log ``metrics/trainer.jsonl``.

After the last step: a checkpoint (``ckpt.at_end``) and ``<output_dir>/final/``, the model as a
Hugging Face directory with a model card (``export_final``, ``export.py``); with DiLoCo the global
model (``diloco/loop.py``: ``finish``).

Run it through ``rl`` or alone: ``uv run trainer @ <output_dir>/configs/trainer.json`` (under
``torchrun`` for several ranks).
"""

from __future__ import annotations

import logging
import shutil
import time
from typing import Any

import torch

from prime_composer.checkpoint_layout import resume_step
from prime_composer.config.errors import RunError
from prime_composer.config.optim import OptimConfig
from prime_composer.config.trainer import TrainerConfig
from prime_composer.diloco.base import OuterLoop, build_outer_loop
from prime_composer.metrics import MetricsLogger
from prime_composer.trainer.checkpoint import CheckpointManager
from prime_composer.trainer.export import export_final
from prime_composer.trainer.lora import (
    adapter_config,
    adapter_state_dict,
    apply_lora,
    base_fingerprint,
    check_base,
    lora_record,
)
from prime_composer.trainer.losses.aggregate import all_reduce_sum
from prime_composer.trainer.losses.base import TermContext, build_terms
from prime_composer.trainer.model import (
    World,
    close_distributed,
    full_state_dict,
    init_distributed,
    load_model,
    shard_model,
)
from prime_composer.trainer.optim import build_optimizer, lr_factor, optimizer_step
from prime_composer.trainer.step import train_step
from prime_composer.transport.adapter import publish_adapter
from prime_composer.transport.batch import MicroBatch
from prime_composer.transport.factory import make_receiver
from prime_composer.transport.weights import NonFiniteWeightsError, check_finite, parse_step, publish_weights

logger = logging.getLogger(__name__)


class Trainer:
    def __init__(self, config: TrainerConfig, world: World) -> None:
        self.config = config
        self.world = world
        torch.manual_seed(config.seed)
        self.lora = config.model.lora if config.model.lora_enabled else None
        self.lora_record: dict[str, Any] | None = None
        model, self.tokenizer = load_model(config.model, world.device)
        self.hf_config = model.config
        if self.lora is not None:
            self.lora_record = lora_record(config.model.name, base_fingerprint(model), self.lora)
            model = apply_lora(model, self.lora)
        replicate = config.parallel.replicate
        self.model = (
            shard_model(model, world, config.mixed_precision, replicate) if world.is_distributed else model
        )
        self.optimizer, self.scheduler = build_optimizer(self.model, config.optim, config.max_steps)
        # Under FSDP a policy copy is loaded (with its adapters) and sharded like the policy (a
        # sharded module cannot be deep-copied); the policy's local shards are then copied in.
        make_copy = self._load_and_shard if world.is_distributed else None
        self.terms_context = TermContext(self.model, make_copy=make_copy, world_size=world.world_size)
        self.terms = build_terms(config.loss, self.terms_context)
        self.ckpt = CheckpointManager(
            config.output_dir / "checkpoints", config.ckpt.keep, world, parts=config.ckpt.parts
        )
        # The outer loop wraps the step from outside: after each optimizer step it may move the
        # weights (an outer step), which the publish that follows then serves.
        self.outer: OuterLoop | None = (
            build_outer_loop(config.diloco, self.model, self.optimizer, config.output_dir / "diloco")
            if config.diloco.enabled
            else None
        )
        self.broadcast_root = config.output_dir / "broadcasts"
        self.metrics = MetricsLogger(config.output_dir, "trainer") if world.is_main else None
        self.start_step = 0
        self.num_skipped_in_a_row = 0

    def _load_and_shard(self) -> torch.nn.Module:
        model = load_model(self.config.model, self.world.device)[0]
        if self.lora is not None:
            model = apply_lora(model, self.lora)
        return shard_model(model, self.world, self.config.mixed_precision, self.config.parallel.replicate)

    def resume(self) -> None:
        ckpt = self.config.ckpt
        step = resume_step(self.config.output_dir / "checkpoints", ckpt.resume_step, ckpt.parts)
        check_same_resume_step(step, self.world)
        where = f"the trainer checkpoint of step {step} in {self.config.output_dir / 'checkpoints'}"
        saved = self.ckpt.read_extra(step)
        check_base(saved.get("lora"), self.lora_record, where)
        check_same_model(saved.get("model"), self.config.model.name, where)
        self.ckpt.load(
            step,
            self.model,
            self.optimizer,
            self.scheduler,
            states=self._checkpoint_states(),
            model_name=self.config.model.name,
        )
        apply_changed_optim(
            saved.get("optim"), self.config.optim, self.optimizer, self.scheduler, step, self.config.max_steps
        )
        if self.outer is not None:  # after the model: it may catch up with newer global weights
            self.outer.load(self.config.output_dir / "checkpoints", step)
        self.start_step = step
        logger.info("resumed from the checkpoint of step %d", step)
        # The inference server restarts on the base weights: republish the resumed ones.
        self.publish(step)

    def publish(self, step: int) -> None:
        """Write ``broadcasts/step_<step>`` (collective under FSDP; rank 0 writes): the whole
        weights, or with LoRA the adapter only (``transport/adapter.py``).

        Non-finite weights are never published: every rank checks its own shards of the trained
        parameters first and all stop together with a ``RunError`` (a check on rank 0 alone would
        leave the others waiting)."""
        local = {name: _local(p.detach()) for name, p in self.model.named_parameters() if p.requires_grad}
        bad = torch.tensor(0.0)
        try:
            check_finite(local, f"the weights after step {step}")
        except NonFiniteWeightsError as e:
            bad, reason = torch.tensor(1.0), str(e)
        if float(all_reduce_sum(bad)) > 0:
            raise RunError(
                (reason if bad.item() else f"the weights after step {step} are not finite on another rank")
                + f". The policy has diverged: lower trainer.optim.lr (now {self.config.optim.lr}) or "
                "trainer.optim.max_grad_norm"
            )
        if self.lora is not None:
            adapter = adapter_state_dict(self.model)
            if self.world.is_main:
                publish_adapter(adapter, adapter_config(self.model), self.broadcast_root, step)
        else:
            state = full_state_dict(self.model)
            if self.world.is_main:
                publish_weights(state, self.hf_config, self.broadcast_root, step)
        if self.world.is_main:
            self._prune_broadcasts(keep=self.config.keep_broadcasts)
        self.world.barrier()

    def _prune_broadcasts(self, keep: int) -> None:
        steps = sorted(s for p in self.broadcast_root.iterdir() if (s := parse_step(p)) is not None)
        for step in steps[:-keep]:
            shutil.rmtree(self.broadcast_root / f"step_{step}", ignore_errors=True)

    def save_checkpoint(self, step: int) -> None:
        # What resume checks the config against: the model trained, the optimizer settings that
        # live on in the optimizer's and scheduler's state.
        extra: dict[str, Any] = {
            "model": {"name": self.config.model.name},
            "optim": self.config.optim.model_dump(mode="json"),
        }
        if self.lora_record is not None:
            extra["lora"] = self.lora_record
        self.ckpt.save(
            step, self.model, self.optimizer, self.scheduler, extra=extra, states=self._checkpoint_states()
        )
        if self.outer is not None:
            root = self.config.output_dir / "checkpoints"
            self.outer.save(root, step)
            self.ckpt.commit(step)  # the step is complete once the DiLoCo part is there too

    def _checkpoint_states(self) -> dict[str, Any]:
        """State saved beside model and optimizer: the policy copies the loss terms made (an EMA or
        frozen SDPO teacher, the KL reference)."""
        return self.terms_context.checkpoint_states()

    def run(self) -> None:
        config = self.config
        receiver = make_receiver(config.transport, config.output_dir)
        try:
            for step in range(self.start_step, config.max_steps):
                if config.ckpt.interval and step % config.ckpt.interval == 0 and step != self.start_step:
                    self.save_checkpoint(step)
                t0 = time.monotonic()
                micro_batches = receiver.receive(step, self.world.rank)
                wait_s = time.monotonic() - t0
                metrics = self.step(micro_batches, step)
                metrics["time/wait_data_s"] = wait_s
                self.publish(step + 1)
                metrics["time/step_total_s"] = time.monotonic() - t0
                if self.metrics is not None:
                    self.metrics.log(step, metrics)
                logger.info(
                    "step %d: loss %.4f grad_norm %.3f %.0f tok/s",
                    step,
                    metrics["loss/total"],
                    metrics["grad_norm"],
                    metrics["perf/tokens_per_s"],
                )
            if config.ckpt.at_end and self.start_step < config.max_steps:
                self.save_checkpoint(config.max_steps)
            # After the last checkpoint (which keeps the local model and the round in flight): the
            # shardcast loop applies that round and gives the model the global weights, so final/
            # is the model every DC agrees on; torchft's model is already what its last round left.
            if self.outer is not None:
                self.outer.finish()
            if config.export_final:
                lora_export = self.lora.export if self.lora is not None else None
                export_final(self.model, self.tokenizer, config.output_dir, self.world, lora=lora_export)
        finally:
            receiver.close()
            if self.outer is not None:
                self.outer.close()

    def step(self, micro_batches: list[MicroBatch], step: int | None = None) -> dict[str, Any]:
        """One optimizer step on this rank's micro-batches (``step``: its index, for the outer loop)."""
        t0 = time.monotonic()
        optim = self.config.optim
        result = train_step(
            self.model,
            micro_batches,
            self.terms,
            self.world.device,
            self.world.world_size,
            defer_grad_sync=optim.defer_grad_sync,
        )
        outcome = optimizer_step(self.model, self.optimizer, self.scheduler, optim.max_grad_norm, result.loss)
        if not outcome.skipped:
            self.terms_context.after_optimizer_step()
            self.num_skipped_in_a_row = 0
        else:
            self.num_skipped_in_a_row += 1
            if self.num_skipped_in_a_row >= self.config.max_skipped_steps:
                raise RunError(
                    f"the loss or gradient norm was not finite {self.num_skipped_in_a_row} steps in a row "
                    f"(last: loss {result.loss.item()}, grad norm {outcome.grad_norm}): the policy has diverged. "
                    f"Lower trainer.optim.lr (now {optim.lr}) or trainer.optim.max_grad_norm, or check the "
                    "rewards (trainer.max_skipped_steps sets how many skipped steps stop the run)"
                )
        num_tokens = int(all_reduce_sum(torch.tensor(result.num_tokens, dtype=torch.float64)).item())
        outer_metrics: dict[str, float] = {}
        if self.outer is not None:
            index = step if step is not None else self.start_step
            self.outer.after_inner_step(index, num_tokens, skipped=outcome.skipped)
            outer_metrics = {
                f"diloco/{k.removeprefix('diloco/')}": v for k, v in self.outer.last_metrics.items()
            }
        elapsed = time.monotonic() - t0
        return {
            **outer_metrics,
            "loss/total": result.loss.item(),
            "entropy": result.metrics.get("rl/entropy"),
            **result.metrics,
            "grad_norm": outcome.grad_norm,
            "lr": outcome.lr,
            "train/skipped": float(outcome.skipped),
            "perf/tokens_per_s": num_tokens / max(elapsed, 1e-9),
            "perf/num_tokens": num_tokens,
            "time/step_s": elapsed,
        }


def check_same_model(saved: dict[str, Any] | None, name: str, where: str) -> None:
    """Refuse to resume ``where`` (trained from ``saved["name"]``) with another ``model.name``."""
    if saved is not None and saved.get("name") != name:
        raise ValueError(
            f"{where} was trained from model.name = {saved.get('name')!r}, but this run's model.name is "
            f"{name!r}: resume with the model it was trained from, or start a new run (another output_dir)"
        )


def check_same_resume_step(step: int, world: World) -> None:
    """Every rank resumes from the same step (another node's ``rl`` finds the newest complete
    checkpoint itself): a ``RunError`` naming the steps otherwise, on every rank."""
    if not world.is_distributed:
        return
    steps: list[Any] = [None] * world.world_size
    torch.distributed.all_gather_object(steps, step)
    if len(set(steps)) > 1:
        raise RunError(
            f"the trainer ranks would resume from different checkpoints (steps {sorted(set(steps))} by rank: "
            f"{steps}); is output_dir the same shared directory on every node? Resume with "
            "--ckpt.resume-step N on every node"
        )


def apply_changed_optim(
    saved: dict[str, Any] | None,
    cfg: OptimConfig,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    step: int,
    max_steps: int,
) -> list[str]:
    """Apply optimizer settings that changed since the checkpoint was saved (lr, betas, eps,
    weight_decay), which loading the optimizer's and scheduler's state would otherwise silently
    undo; log each as changed at ``step``. The schedule itself (warm-up, decay, ``max_steps``) is
    always the config's. Returns the changed fields."""
    if saved is None:
        return []
    fields = ("lr", "betas", "eps", "weight_decay")
    now = cfg.model_dump(mode="json")
    changed = [f for f in fields if f in saved and saved[f] != now[f]]
    if not changed:
        return []
    for name in changed:
        logger.warning(
            "trainer.optim.%s changed on resume at step %d: %s -> %s (applied from this step)",
            name,
            step,
            saved[name],
            now[name],
        )
    factor = lr_factor(scheduler.last_epoch, cfg, max_steps)
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.lr
        group["lr"] = cfg.lr * factor
        group["betas"] = tuple(cfg.betas)
        group["eps"] = cfg.eps
        if group["weight_decay"] != 0.0:  # the decayed group (norms and biases never decay)
            group["weight_decay"] = cfg.weight_decay
    scheduler.base_lrs = [cfg.lr for _ in optimizer.param_groups]
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # type: ignore[attr-defined]
    return changed


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local shard of a DTensor (FSDP2 parameter), the tensor itself otherwise."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def train(config: TrainerConfig) -> None:
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    world = init_distributed()
    trainer = Trainer(config, world)
    if config.ckpt.resume or config.ckpt.resume_step is not None:
        try:
            trainer.resume()
        except ValueError as e:  # a checkpoint of another model, a state it lacks: one line, no retry
            raise RunError(str(e)) from None
    trainer.run()
    close_distributed()

"""The RL trainer loop: receive a step's micro-batches, take one optimizer step, publish weights.

For step ``s`` (model = policy after ``s`` optimizer steps):

1. checkpoint every ``ckpt.interval`` steps (the state *before* step ``s``, as the orchestrator's
   part of the same checkpoint);
2. receive this rank's micro-batches of step ``s`` (the trainer never samples: the orchestrator
   decides what to learn from);
3. forward/backward each micro-batch with the loss normalised by the step's *global* counts, so
   the gradient does not depend on how samples were split over ranks and micro-batches;
4. clip, and skip the update if the loss or grad norm is not finite (logged, never silent);
5. publish the new weights as ``broadcasts/step_<s+1>/`` for the inference server;
6. log ``metrics/trainer.jsonl``.

Run it through ``rl`` or alone: ``uv run trainer @ <output_dir>/configs/trainer.json`` (under
``torchrun`` for several ranks).
"""

from __future__ import annotations

import logging
import shutil
import time
from typing import Any

import torch
from torch import nn

from prime_composer.checkpoint_layout import resume_step
from prime_composer.config.loss import LossConfig
from prime_composer.config.trainer import TrainerConfig
from prime_composer.metrics import MetricsLogger
from prime_composer.trainer.checkpoint import CheckpointManager
from prime_composer.trainer.forward import packed_token_logprobs
from prime_composer.trainer.losses.aggregate import accumulate_metrics, finalize_metrics, rl_normalizer
from prime_composer.trainer.losses.logprobs import entropy_from_logits
from prime_composer.trainer.losses.rl import rl_loss
from prime_composer.trainer.model import World, full_state_dict, init_distributed, load_model, shard_model
from prime_composer.trainer.optim import build_optimizer, clip_grad_norm
from prime_composer.trainer.sdpo_term import SDPOTerm
from prime_composer.trainer.teacher import TeacherModel
from prime_composer.transport.batch import MicroBatch
from prime_composer.transport.factory import make_receiver
from prime_composer.transport.weights import parse_step, publish_weights

logger = logging.getLogger(__name__)


def _dense_segments(sample_ids: torch.Tensor) -> torch.Tensor:
    """Sample ids renumbered 0..n-1 within the micro-batch (the loss indexes B*T slots by them)."""
    return torch.unique(sample_ids, return_inverse=True)[1]


def _all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        value = value.clone()
        torch.distributed.all_reduce(value)
    return value


def train_step(
    model: nn.Module,
    micro_batches: list[MicroBatch],
    loss_cfg: LossConfig,
    device: torch.device,
    world_size: int = 1,
    teacher: TeacherModel | None = None,
) -> tuple[torch.Tensor, dict[str, float], int]:
    """Forward and backward over one rank's micro-batches of a step (gradients accumulate).

    The loss is ``rl + loss.sdpo.weight * sdpo``; the SDPO term (``SDPOTerm``, needs ``teacher``)
    runs only when the weight is above 0, and its teacher forward only for micro-batches with
    hinted samples.

    Returns ``(loss, metrics, num_tokens)``: the step's total loss summed over every rank, the
    reduced loss metrics (with ``loss/rl`` and, with SDPO, ``loss/sdpo``), and the non-padding
    tokens this rank processed.
    """
    segments = [_dense_segments(mb.sample_ids) for mb in micro_batches]
    normalizer = rl_normalizer([mb.loss_mask for mb in micro_batches], loss_cfg.rl, segments)
    sdpo_weight = loss_cfg.sdpo.weight
    sdpo: SDPOTerm | None = None
    if sdpo_weight > 0:
        if teacher is None:
            raise ValueError("train_step: loss.sdpo.weight > 0 needs a TeacherModel")
        sdpo = SDPOTerm(teacher, loss_cfg.sdpo, micro_batches)
    total = torch.zeros((), dtype=torch.float32, device=device)
    rl_total = torch.zeros((), dtype=torch.float32, device=device)
    sdpo_total = torch.zeros((), dtype=torch.float32, device=device)
    acc: dict[str, torch.Tensor] = {}
    num_tokens = 0
    for index, (mb, segment_ids) in enumerate(zip(micro_batches, segments, strict=True)):
        mb = mb.to(device)
        # Teacher first: its activations are gone before the student's are alive.
        teacher_logits = sdpo.teacher_logits(index, mb) if sdpo is not None else None
        logprobs, logits = packed_token_logprobs(model, mb, mb.temperature, return_logits=True)
        assert logits is not None
        # Entropy is only logged: compute it on the loss tokens alone, not on every prompt and
        # padding position (logits[:, t] is the distribution token t was sampled from).
        entropy = torch.zeros_like(logprobs, dtype=torch.float32)
        entropy[mb.loss_mask] = entropy_from_logits(logits.detach()[mb.loss_mask]).float()
        loss, metrics = rl_loss(
            logprobs,
            mb.inference_logprobs,
            mb.advantages,
            mb.loss_mask,
            loss_cfg.rl,
            normalizer,
            entropy=entropy,
            segment_ids=segment_ids.to(device),
        )
        rl_total += loss.detach().float()
        if sdpo is not None and teacher_logits is not None:
            sdpo_part, sdpo_metrics = sdpo.loss(logits, mb, teacher_logits)
            loss = loss + sdpo_weight * sdpo_part
            sdpo_total += sdpo_part.detach().float()
            metrics.update(sdpo_metrics)
        # The normalizer is global, so the step's gradient is the SUM of every rank's; FSDP
        # averages gradients over ranks, which the world-size factor undoes.
        (loss * world_size).backward()
        total += loss.detach().float()
        acc = accumulate_metrics(acc, metrics)
        num_tokens += int((mb.sample_ids >= 0).sum())
    reduced = finalize_metrics(acc)
    reduced["loss/rl"] = float(_all_reduce_sum(rl_total))
    if sdpo is not None:
        reduced["loss/sdpo"] = float(_all_reduce_sum(sdpo_total))
        reduced["sdpo/num_tokens"] = sdpo.normalizer
    return _all_reduce_sum(total), reduced, num_tokens


class Trainer:
    def __init__(self, config: TrainerConfig, world: World) -> None:
        self.config = config
        self.world = world
        torch.manual_seed(config.seed)
        model, _ = load_model(config.model, world.device)
        self.hf_config = model.config
        self.model = shard_model(model, world, config.mixed_precision) if world.is_distributed else model
        self.optimizer, self.scheduler = build_optimizer(self.model, config.optim, config.max_steps)
        self.teacher: TeacherModel | None = None
        if config.loss.sdpo.weight > 0:
            # Under FSDP the copy is loaded and sharded like the policy (a sharded module cannot be
            # deep-copied); the policy's local shards are then copied in.
            make_copy = (
                (
                    lambda: shard_model(
                        load_model(config.model, world.device)[0], world, config.mixed_precision
                    )
                )
                if world.is_distributed
                else None
            )
            self.teacher = TeacherModel(self.model, config.loss.sdpo, make_copy=make_copy)
        self.ckpt = CheckpointManager(config.output_dir / "checkpoints", config.ckpt.keep, world)
        self.broadcast_root = config.output_dir / "broadcasts"
        self.metrics = MetricsLogger(config.output_dir, "trainer") if world.is_main else None
        self.start_step = 0

    def resume(self) -> None:
        step = resume_step(self.config.output_dir / "checkpoints", self.config.ckpt.resume_step)
        self.ckpt.load(step, self.model, self.optimizer, self.scheduler, states=self._checkpoint_states())
        self.start_step = step
        logger.info("resumed from the checkpoint of step %d", step)
        # The inference server restarts on the base weights: republish the resumed ones.
        self.publish(step)

    def publish(self, step: int) -> None:
        """Write ``broadcasts/step_<step>`` (collective under FSDP; rank 0 writes)."""
        state = full_state_dict(self.model)
        if self.world.is_main:
            publish_weights(state, self.hf_config, self.broadcast_root, step)
            self._prune_broadcasts(keep=self.config.keep_broadcasts)
        self.world.barrier()

    def _prune_broadcasts(self, keep: int) -> None:
        steps = sorted(s for p in self.broadcast_root.iterdir() if (s := parse_step(p)) is not None)
        for step in steps[:-keep]:
            shutil.rmtree(self.broadcast_root / f"step_{step}", ignore_errors=True)

    def save_checkpoint(self, step: int) -> None:
        self.ckpt.save(step, self.model, self.optimizer, self.scheduler, states=self._checkpoint_states())

    def _checkpoint_states(self) -> dict[str, Any]:
        """State saved beside model and optimizer: the SDPO teacher's weights when it has its own
        (``ema``, ``frozen``); a ``live`` teacher is the policy."""
        if self.teacher is None or self.teacher.kind == "live":
            return {}
        return {"sdpo_teacher": self.teacher}

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
                metrics = self.step(micro_batches)
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
        finally:
            receiver.close()

    def step(self, micro_batches: list[MicroBatch]) -> dict[str, Any]:
        t0 = time.monotonic()
        self.optimizer.zero_grad(set_to_none=True)
        loss, loss_metrics, num_tokens = train_step(
            self.model,
            micro_batches,
            self.config.loss,
            self.world.device,
            self.world.world_size,
            self.teacher,
        )
        grad_norm = clip_grad_norm(self.model, self.config.optim.max_grad_norm)
        finite = bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm))
        if finite:
            self.optimizer.step()
            if self.teacher is not None:
                self.teacher.update(self.model)
        else:
            logger.warning(
                "non-finite loss (%s) or grad norm (%s): update skipped", loss.item(), grad_norm.item()
            )
            self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        elapsed = time.monotonic() - t0
        num_tokens = int(_all_reduce_sum(torch.tensor(num_tokens, dtype=torch.float64)).item())
        return {
            "loss/total": loss.item(),
            "entropy": loss_metrics.get("rl/entropy"),
            **loss_metrics,
            "grad_norm": grad_norm.item(),
            "lr": lr,
            "train/skipped": 0.0 if finite else 1.0,
            "perf/tokens_per_s": num_tokens / max(elapsed, 1e-9),
            "perf/num_tokens": num_tokens,
            "time/step_s": elapsed,
        }


def train(config: TrainerConfig) -> None:
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    world = init_distributed()
    trainer = Trainer(config, world)
    if config.ckpt.resume or config.ckpt.resume_step is not None:
        trainer.resume()
    trainer.run()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()

"""The ``sft`` command: supervised fine-tuning on the assistant turns of chat conversations.

    uv run sft --data chats.jsonl --max-steps 30 --output-dir outputs/run
    uv run sft @ configs/sft.toml --resume
    torchrun --nproc-per-node 2 -m prime_composer.trainer.sft @ configs/sft.toml   # FSDP2

Objective: cross-entropy summed over the assistant tokens of the whole step's batch (all micro
batches, all ranks) divided by their global count, so every target token weighs the same however
the batch is split (what TRL calls per-token normalisation over the global batch). Every rank
tokenizes the whole file, so the global count is known without a collective; FSDP2 averages
gradients over ranks, so each rank scales its loss by the number of ranks to get the sum.

Outputs: ``<output_dir>/metrics/sft.jsonl`` (``loss``, ``lr``, ``grad_norm``,
``perf/tokens_per_s``, ...), checkpoints in ``<output_dir>/sft/checkpoints/step_N/trainer/``, and
the fine-tuned model as a Hugging Face directory ``<output_dir>/sft/final/`` (use it as
``model.name``).
"""

from __future__ import annotations

import logging
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from prime_composer.config.cli import exit_process, run_entry_point
from prime_composer.config.sft import SFTConfig
from prime_composer.logs import setup_logging
from prime_composer.metrics import MetricsLogger
from prime_composer.trainer.checkpoint import CheckpointManager
from prime_composer.trainer.export import save_hf_directory
from prime_composer.trainer.model import World, close_distributed, init_distributed, load_model, shard_model
from prime_composer.trainer.optim import build_optimizer, optimizer_step, set_grad_sync
from prime_composer.trainer.sft_data import PaddedBatch, SFTSample, batch_indices, collate, load_sft_samples

logger = logging.getLogger("prime_composer.sft")


def sft_dir(output_dir: Path) -> Path:
    """Where the ``sft`` command keeps its checkpoints and final model inside the run directory."""
    return Path(output_dir) / "sft"


def token_loss_sum(
    model: nn.Module, batch: PaddedBatch, device: torch.device, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Sum of next-token cross-entropy over the tokens in ``batch.loss_mask`` (float32 scalar).

    ``loss_mask[b, t]`` marks token ``t`` as a target, predicted from the logits at ``t - 1``.
    With ``label_smoothing`` the target is ``(1 - label_smoothing) * onehot + label_smoothing / V``.
    """
    input_ids = batch.input_ids.to(device)
    logits = model(
        input_ids=input_ids, attention_mask=batch.attention_mask.to(device), use_cache=False
    ).logits
    targets = input_ids[:, 1:]
    mask = batch.loss_mask[:, 1:].to(device)
    per_token = F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        reduction="none",
        label_smoothing=label_smoothing,
    )
    return (per_token * mask.reshape(-1)).sum()


def rank_micro_batches(
    step_samples: list[SFTSample], world: World, micro_batch_size: int, pad_id: int
) -> list[PaddedBatch]:
    """This rank's share of the step (every ``world_size``-th sample) in micro-batches."""
    mine = step_samples[world.rank :: world.world_size]
    return [collate(mine[i : i + micro_batch_size], pad_id) for i in range(0, len(mine), micro_batch_size)]


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    micro_batches: list[PaddedBatch],
    num_loss_tokens: int,
    world: World,
    max_grad_norm: float,
    label_smoothing: float = 0.0,
    defer: bool = False,
) -> dict[str, float]:
    """Forward/backward every micro-batch, clip, step; returns the step's metrics.

    ``num_loss_tokens`` is the global count of target tokens of the step (all ranks). A
    non-finite gradient norm skips the update (the scheduler still advances) and is logged
    (``optim.optimizer_step``, shared with the RL trainer). ``defer``: ``optim.defer_grad_sync``.
    """
    loss_sum = torch.zeros((), dtype=torch.float32, device=world.device)
    for i, batch in enumerate(micro_batches):
        set_grad_sync(model, i, len(micro_batches), defer)
        micro_sum = token_loss_sum(model, batch, world.device, label_smoothing)
        (micro_sum * (world.world_size / num_loss_tokens)).backward()
        loss_sum += micro_sum.detach()
    if world.is_distributed:
        dist.all_reduce(loss_sum)
    outcome = optimizer_step(model, optimizer, scheduler, max_grad_norm)
    return {
        "loss": loss_sum.item() / num_loss_tokens,
        "grad_norm": outcome.grad_norm,
        "lr": outcome.lr,
        "skipped": float(outcome.skipped),
    }


def run_sft(cfg: SFTConfig) -> int:
    """Train, checkpoint and export as ``cfg`` says; returns the exit code (0)."""
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    world = init_distributed()
    try:
        _train(cfg, world)
    except BaseException:
        if dist.is_initialized():  # no barrier: the other ranks may never reach one
            dist.destroy_process_group()
        raise
    close_distributed()
    return 0


def _train(cfg: SFTConfig, world: World) -> None:
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    num_per_rank = cfg.batch_size // world.world_size
    if cfg.batch_size % (world.world_size * cfg.micro_batch_size):
        raise ValueError(
            f"batch_size ({cfg.batch_size}) must be a multiple of micro_batch_size "
            f"({cfg.micro_batch_size}) x ranks ({world.world_size}), so every rank runs as many micro-batches"
        )

    run_dir = sft_dir(cfg.output_dir)
    checkpoints = CheckpointManager(run_dir / "checkpoints", cfg.ckpt.keep, world)
    resuming = cfg.ckpt.resume or cfg.ckpt.resume_step is not None
    start = checkpoints.resolve_step(cfg.ckpt.resume_step) if resuming else 0  # fail before loading

    # Under FSDP every rank loads on CPU and sharding moves only its shards to the device.
    model, tokenizer = load_model(cfg.model, torch.device("cpu") if world.is_distributed else world.device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    samples = load_sft_samples(cfg.data, tokenizer, cfg.seq_len)
    logger.info("%d conversations from %s; %d per rank per step", len(samples), cfg.data, num_per_rank)
    model = shard_model(model, world, mixed_precision=False)
    optimizer, scheduler = build_optimizer(model, cfg.optim, cfg.max_steps)

    if resuming:
        extra = checkpoints.load(start, model, optimizer, scheduler, model_name=cfg.model.name)
        if extra.get("num_samples") != len(samples):
            raise ValueError(
                f"the checkpoint of step {start} was trained on {extra.get('num_samples')} conversations, "
                f"but data = '{cfg.data}' has {len(samples)}: resume with the same data file"
            )
        logger.info("resumed from step %d", start)
    metrics = MetricsLogger(cfg.output_dir, "sft") if world.is_main else None

    for step in range(start, cfg.max_steps):
        started = time.perf_counter()
        step_samples = [samples[i] for i in batch_indices(step, cfg.batch_size, len(samples), cfg.seed)]
        num_loss_tokens = sum(s.num_loss_tokens for s in step_samples)
        num_tokens = sum(len(s.input_ids) for s in step_samples)
        micro_batches = rank_micro_batches(step_samples, world, cfg.micro_batch_size, pad_id)
        record = train_step(
            model,
            optimizer,
            scheduler,
            micro_batches,
            num_loss_tokens,
            world,
            cfg.optim.max_grad_norm,
            cfg.label_smoothing,
            cfg.optim.defer_grad_sync,
        )
        elapsed = time.perf_counter() - started
        record.update(
            {
                "num_loss_tokens": num_loss_tokens,
                "perf/tokens_per_s": num_tokens / elapsed,
                "perf/step_time_s": elapsed,
            }
        )
        done = step + 1
        if metrics is not None:
            metrics.log(done, record)
        if world.is_main and (done % cfg.log_every == 0 or done == cfg.max_steps):
            logger.info(
                "step %d/%d  loss %.4f  lr %.2e  grad_norm %.3f  %.0f tok/s",
                done,
                cfg.max_steps,
                record["loss"],
                record["lr"],
                record["grad_norm"],
                record["perf/tokens_per_s"],
            )
        periodic = cfg.ckpt.interval and done % cfg.ckpt.interval == 0
        if periodic or (cfg.ckpt.at_end and done == cfg.max_steps):
            checkpoints.save(
                done,
                model,
                optimizer,
                scheduler,
                extra={"num_samples": len(samples)},
                model_name=cfg.model.name,
            )

    final = save_hf_directory(model, tokenizer, run_dir / "final", world)
    if world.is_main:
        logger.info("fine-tuned model: %s (use it as model.name)", final)


def _run_command(cfg: SFTConfig) -> int:
    rank = os.environ.get("RANK")
    setup_logging("sft" if rank in (None, "0") else f"sft[{rank}]")
    return run_sft(cfg)


def main() -> None:
    exit_process(
        run_entry_point(
            SFTConfig,
            _run_command,
            prog="sft",
            env_prefix="PRIME_COMPOSER_SFT__",
            aliases={"--resume": "ckpt.resume=true"},
            describe="Supervised fine-tuning on the assistant turns of chat JSONL; writes a Hugging Face "
            "model directory to <output_dir>/sft/final.",
        )
    )


if __name__ == "__main__":
    main()

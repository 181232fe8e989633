"""Benchmark: training tokens/s of our trainer step against TRL's ``GRPOTrainer`` step, one run.

Both trainers train the same model (same initial weights, two copies) on the same step: the same
samples (``--num-samples`` rollouts in groups of ``--group-size``, prompt and completion lengths
drawn uniformly from ``--prompt-len`` and ``--completion-len``), the same inference logprobs and
advantages, and the same loss: DAPO (clipped ratio against the sampling logprobs, eps 0.2 / 0.28,
token-mean over the step's loss tokens), no KL, temperature 1. Only training is timed: forward,
loss, backward, gradient clipping (max norm 1) and the AdamW step; generation and input
preparation are not.

- ``ours``: ``pack_step`` packs the samples into rows of ``--seq-len`` tokens (not timed), then
  the step of ``trainer/train.py``: zero grads, ``train_step`` over the micro-batches (packed
  forward, ``rl_loss``, entropy metric), ``clip_grad_norm``, ``optimizer.step``.
- ``trl``: a real ``GRPOTrainer`` (``use_vllm=False``, ``loss_type="dapo"``, ``beta=0``) built on
  a tiny dataset and a constant reward; its inputs are made here the way
  ``_generate_and_score_completions`` makes them (prompts left-padded, completions right-padded,
  over the whole step, then split into ``--trl-batch-size`` rows per micro-batch), with
  ``old_per_token_logps`` = the sampling logprobs, as in async/vLLM training. The timed step is
  what ``Trainer``'s inner loop does: ``compute_loss`` + ``accelerator.backward`` per micro-batch,
  ``accelerator.clip_grad_norm_``, ``optimizer.step`` (its default optimizer), scheduler step,
  ``zero_grad``.

- ``raw``: the physical limit of the step, a third copy of the weights trained on our packed
  micro-batches with no RL bookkeeping: the decoder forward, the output head at the loss tokens
  only, ``F.cross_entropy``, backward, the same clip and AdamW (``RawStep``).

Tokens/s counts the samples' real tokens (prompt + completion, no padding), the same number for
all, so the ratio is TRL's step time over ours. The sides run one after the other in every round,
their order rotating (drift on a shared machine hits all alike), with
``torch.set_num_threads(--threads)``; each reports the median over ``--steps`` rounds after
``--warmup``, and each ratio is the median over the rounds of that round's ratio. As a check that
the work is the same, the first step's losses of ours and TRL's must agree (same weights, same
objective).

Configs: ``tiny`` is ``builtin:tiny-qwen3`` (0.45M parameters; overhead-bound) and ``qwen3-512x8``
a Qwen3 built from a config with random weights (hidden 512, 8 layers, vocab ``--vocab``), where
the matmuls dominate. The last line is ``ratio_vs_trl=X ratio_vs_raw=Y`` for ``--main`` (``tiny``
by default; targets X >= 2.0, Y <= 1.15): X = TRL's step time / ours, Y = ours / the raw step's.

Run::

    uv run python bench/trainer.py                        # tiny and qwen3-512x8
    uv run python bench/trainer.py --configs tiny --steps 10
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch
import torch.nn.functional as F
from torch import nn

from prime_composer.config.base import ModelConfig
from prime_composer.config.loss import LossConfig, RLLossConfig
from prime_composer.config.optim import OptimConfig
from prime_composer.orchestrator.packing import pack_step
from prime_composer.orchestrator.sample import Sample
from prime_composer.trainer.losses.base import TermContext, build_terms
from prime_composer.trainer.model import load_model
from prime_composer.trainer.optim import build_optimizer, clip_grad_norm
from prime_composer.trainer.step import train_step
from prime_composer.transport.batch import MicroBatch

CONFIGS = ("tiny", "qwen3-512x8")
LR = 1e-5
MAX_GRAD_NORM = 1.0
EPS_LOW, EPS_HIGH = 0.2, 0.28


@dataclass
class Workload:
    """The step both trainers train on."""

    samples: list[Sample]
    seq_len: int
    micro_batch_size: int
    trl_batch_size: int
    pad_token_id: int
    group_size: int

    @property
    def num_tokens(self) -> int:
        return sum(len(s.prompt_ids) + len(s.completion_ids) for s in self.samples)


def build_models(name: str, vocab: int) -> tuple[nn.Module, nn.Module, Any]:
    """``(ours, theirs, tokenizer)``: two copies of the same weights (TRL patches its model's forward;
    the raw side gets a third copy of ours)."""
    model, tokenizer = load_model(
        ModelConfig(name="builtin:tiny-qwen3", dtype="float32"), torch.device("cpu")
    )
    if name == "qwen3-512x8":
        from transformers import AutoModelForCausalLM, Qwen3Config

        config = Qwen3Config(
            vocab_size=vocab,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
        model.train()
    elif name != "tiny":
        raise SystemExit(f"bench: unknown config {name!r}; choose from {CONFIGS}")
    return model, copy.deepcopy(model), tokenizer


def make_samples(
    model: nn.Module, args: argparse.Namespace, num_samples: int, pad_token_id: int
) -> list[Sample]:
    """Random token sequences scored by ``model`` itself, plus noise, as the sampling logprobs.

    The noise (std ``--logprob-noise``) makes the importance ratios differ from 1 so the clip
    binds on some tokens, as after an off-policy step. Advantages: group reward minus group mean.
    """
    rng = random.Random(args.seed)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(args.seed)
    samples: list[Sample] = []
    for i in range(num_samples):
        num_prompt = rng.randint(*args.prompt_len)
        num_completion = rng.randint(*args.completion_len)
        # Avoid the pad id: TRL's masks come from the padding, not from the ids, but keep it clean.
        ids = [rng.randrange(3, vocab) for _ in range(num_prompt + num_completion)]
        with torch.no_grad():
            logits = model(torch.tensor([ids]), use_cache=False).logits[0].float()
        logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        logprobs = logprobs[num_prompt - 1 :] + args.logprob_noise * torch.randn(
            num_completion, generator=generator
        )
        samples.append(
            Sample(
                prompt_ids=ids[:num_prompt],
                completion_ids=ids[num_prompt:],
                completion_logprobs=logprobs.tolist(),
                completion_mask=[1] * num_completion,
                reward=float(rng.random() < 0.5),
                example_id=i // args.group_size,
                group_id=i // args.group_size,
                policy_step=0,
            )
        )
    for start in range(0, num_samples, args.group_size):
        group = samples[start : start + args.group_size]
        mean = sum(s.reward for s in group) / len(group)
        for s in group:
            s.advantage = s.reward - mean
    return samples


class RawStep:
    """The physical limit of the step: the packed forward, a plain cross-entropy, backward, AdamW.

    The same micro-batches as ``OursStep`` (same rows, same loss tokens), no RL bookkeeping: the
    decoder's hidden states, the output head applied at the loss tokens only (``hidden[t - 1]``
    predicts token ``t``), ``F.cross_entropy`` summed and divided by the step's loss-token count,
    backward per micro-batch, then the same clip and AdamW step. The indices of the loss tokens are
    input preparation (not timed), as the packing is.
    """

    def __init__(self, model: nn.Module, micro_batches: list[MicroBatch]) -> None:
        self.model = model
        self.decoder = model.get_decoder()
        self.head = model.get_output_embeddings()
        self.inputs = []
        for mb in micro_batches:
            rows, cols = (mb.loss_mask & (mb.position_ids != 0)).nonzero(as_tuple=True)
            self.inputs.append((mb.input_ids, mb.position_ids, rows, cols - 1, mb.input_ids[rows, cols]))
        self.num_loss_tokens = sum(len(x[2]) for x in self.inputs)
        optim_cfg = OptimConfig(lr=LR, max_grad_norm=MAX_GRAD_NORM)
        self.optimizer, self.scheduler = build_optimizer(model, optim_cfg, max_steps=1000)

    def __call__(self) -> tuple[float, float]:
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for input_ids, position_ids, rows, prev, targets in self.inputs:
            hidden = self.decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False)
            logits = self.head(hidden.last_hidden_state[rows, prev])
            loss = F.cross_entropy(logits, targets, reduction="sum") / self.num_loss_tokens
            loss.backward()
            total += loss.detach()
        grad_norm = clip_grad_norm(self.model, MAX_GRAD_NORM)
        self.optimizer.step()
        self.scheduler.step()
        return total.item(), grad_norm.item()


class OursStep:
    """The optimizer step of ``prime_composer.trainer.train.Trainer.step`` on packed micro-batches."""

    def __init__(self, model: nn.Module, work: Workload) -> None:
        self.model = model
        rank_batches, stats = pack_step(
            work.samples, work.seq_len, work.micro_batch_size, 1, work.pad_token_id, temperature=1.0
        )
        self.micro_batches: list[MicroBatch] = rank_batches[0]
        self.fill_ratio = stats.fill_ratio
        self.num_padded_tokens = sum(mb.input_ids.numel() for mb in self.micro_batches)
        # The objective TRL computes: no ratio masking (TRL has none), no KL.
        self.loss_cfg = LossConfig(
            rl=RLLossConfig(eps_low=EPS_LOW, eps_high=EPS_HIGH, mask_ratio_low=None, mask_ratio_high=None)
        )
        self.terms = build_terms(self.loss_cfg, TermContext(model))
        optim_cfg = OptimConfig(lr=LR, max_grad_norm=MAX_GRAD_NORM)
        self.optimizer, self.scheduler = build_optimizer(model, optim_cfg, max_steps=1000)
        self.device = torch.device("cpu")

    def __call__(self) -> tuple[float, float]:
        self.optimizer.zero_grad(set_to_none=True)
        loss = train_step(self.model, self.micro_batches, self.terms, self.device).loss
        grad_norm = clip_grad_norm(self.model, MAX_GRAD_NORM)
        if bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm)):
            self.optimizer.step()
        self.scheduler.step()
        return loss.item(), grad_norm.item()


def _left_pad(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([[value] * (width - len(r)) + r for r in rows])


def _right_pad(rows: list[list[Any]], value: Any, dtype: torch.dtype) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=dtype)


class TrlStep:
    """One optimizer step of TRL's ``GRPOTrainer`` (its ``compute_loss``, backward, clip, optimizer)."""

    def __init__(self, model: nn.Module, tokenizer: Any, work: Workload, output_dir: str) -> None:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        num_samples = len(work.samples)
        if num_samples % work.trl_batch_size:
            raise SystemExit(
                f"bench: --num-samples ({num_samples}) must be a multiple of --trl-batch-size ({work.trl_batch_size})"
            )
        num_micro_batches = num_samples // work.trl_batch_size
        args = GRPOConfig(
            output_dir=output_dir,
            report_to="none",
            use_vllm=False,
            use_cpu=True,
            # GRPOConfig defaults to bf16 autocast; ours trains the fp32 model in fp32, and so must TRL
            # (on a CPU without bf16 units its autocast made each matmul ~15x slower).
            bf16=False,
            loss_type="dapo",
            epsilon=EPS_LOW,
            epsilon_high=EPS_HIGH,
            beta=0.0,
            temperature=1.0,
            learning_rate=LR,
            max_grad_norm=MAX_GRAD_NORM,
            per_device_train_batch_size=work.trl_batch_size,
            gradient_accumulation_steps=num_micro_batches,
            num_generations=work.group_size,
            max_completion_length=max(len(s.completion_ids) for s in work.samples),
            lr_scheduler_type="constant",
            logging_steps=1_000_000,
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
        )
        dataset = Dataset.from_dict({"prompt": ["What is 1 + 1?"] * num_samples})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.trainer = GRPOTrainer(
                model=model,
                reward_funcs=[lambda completions, **kwargs: [0.0] * len(completions)],
                args=args,
                train_dataset=dataset,
                processing_class=tokenizer,
            )
        self.trainer.create_optimizer_and_scheduler(num_training_steps=1000)
        # Set by Trainer's training loop, which we do not run; the DAPO normalizer reads it.
        self.trainer.current_gradient_accumulation_steps = num_micro_batches
        self.model = self.trainer.model
        self.model.train()
        self.inputs = self._inputs(work, num_micro_batches)
        self.num_padded_tokens = sum(
            mb["prompt_ids"].numel() + mb["completion_ids"].numel() for mb in self.inputs
        )

    def _inputs(self, work: Workload, num_micro_batches: int) -> list[dict[str, Any]]:
        """What ``_generate_and_score_completions`` returns for the step, split per micro-batch."""
        samples = work.samples
        prompt_ids = _left_pad([s.prompt_ids for s in samples], work.pad_token_id)
        prompt_mask = _left_pad([[1] * len(s.prompt_ids) for s in samples], 0)
        completion_ids = _right_pad([s.completion_ids for s in samples], work.pad_token_id, torch.long)
        completion_mask = _right_pad([[1] * len(s.completion_ids) for s in samples], 0, torch.long)
        old_logps = _right_pad([s.completion_logprobs for s in samples], 0.0, torch.float32)
        advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
        num_items = completion_mask.sum()
        step = {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "advantages": advantages,
            "old_per_token_logps": old_logps,
        }
        size = work.trl_batch_size
        return [
            {**{k: v[i * size : (i + 1) * size] for k, v in step.items()}, "num_items_in_batch": num_items}
            for i in range(num_micro_batches)
        ]

    def __call__(self) -> tuple[float, float]:
        trainer = self.trainer
        total = 0.0
        for inputs in self.inputs:
            with trainer.compute_loss_context_manager():
                loss = trainer.compute_loss(self.model, inputs)
            trainer.accelerator.backward(loss)
            total += loss.item()
        grad_norm = trainer.accelerator.clip_grad_norm_(self.model.parameters(), MAX_GRAD_NORM)
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        self.model.zero_grad()
        return total, float(grad_norm)


def bench_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    ours_model, trl_model, tokenizer = build_models(name, args.vocab)
    num_samples = args.num_samples if name == "tiny" else args.num_samples_large
    samples = make_samples(ours_model, args, num_samples, tokenizer.pad_token_id)
    work = Workload(
        samples,
        args.seq_len,
        args.micro_batch_size,
        args.trl_batch_size,
        tokenizer.pad_token_id,
        args.group_size,
    )
    raw_model = copy.deepcopy(ours_model)
    ours = OursStep(ours_model, work)
    raw = RawStep(raw_model, ours.micro_batches)
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as output_dir:
        theirs = TrlStep(trl_model, tokenizer, work, output_dir)
        steps: dict[str, Callable[[], tuple[float, float]]] = {"ours": ours, "trl": theirs, "raw": raw}
        times: dict[str, list[float]] = {key: [] for key in steps}
        first: dict[str, tuple[float, float]] = {}
        orders = [("ours", "trl", "raw"), ("raw", "ours", "trl"), ("trl", "raw", "ours")]
        for i in range(args.warmup + args.steps):
            # Rotate who goes first, so slow drift of the machine's load hits all sides alike.
            for key in orders[i % len(orders)]:
                began = time.perf_counter()
                result = steps[key]()
                elapsed = time.perf_counter() - began
                first.setdefault(key, result)
                if i >= args.warmup:
                    times[key].append(elapsed)
    num_params = sum(p.numel() for p in ours_model.parameters())
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {
        "config": name,
        "num_params": num_params,
        "num_samples": num_samples,
        "num_tokens": work.num_tokens,
        "padded": {"ours": ours.num_padded_tokens, "trl": theirs.num_padded_tokens},
        "micro_batches": {"ours": len(ours.micro_batches), "trl": len(theirs.inputs)},
        "median_s": medians,
        "tok_s": {k: work.num_tokens / v for k, v in medians.items()},
        # Medians of the rounds' ratios: the sides ran back to back in every round, so a round's
        # ratio sees one load level (the medians of the times alone mix rounds).
        "ratio_vs_trl": statistics.median(t / o for t, o in zip(times["trl"], times["ours"], strict=True)),
        "ratio_vs_raw": statistics.median(o / r for o, r in zip(times["ours"], times["raw"], strict=True)),
        "first": first,
    }


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {CONFIGS}")
    parser.add_argument("--main", default="tiny", help="config whose ratio is the last line")
    parser.add_argument("--num-samples", type=int, default=64, help="rollouts per step (tiny)")
    parser.add_argument("--num-samples-large", type=int, default=32, help="rollouts per step (qwen3-512x8)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=_range, default=(16, 48), help="LOW:HIGH tokens")
    parser.add_argument("--completion-len", type=_range, default=(8, 96), help="LOW:HIGH tokens")
    parser.add_argument("--seq-len", type=int, default=256, help="ours: packed row length")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="ours: rows per micro-batch")
    parser.add_argument("--trl-batch-size", type=int, default=8, help="TRL: samples per micro-batch")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary of qwen3-512x8")
    parser.add_argument("--logprob-noise", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per trainer")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per trainer")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (shared machine: 1)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = [n for n in args.configs.split(",") if n]
    if args.main not in names:
        raise SystemExit(f"bench: --main {args.main!r} is not in --configs {names}")

    results = []
    for name in names:
        result = bench_config(name, args)
        results.append(result)
        print(
            f"[{name}] first-step loss ours {result['first']['ours'][0]:.6f} trl {result['first']['trl'][0]:.6f}; "
            f"grad norm ours {result['first']['ours'][1]:.6f} trl {result['first']['trl'][1]:.6f}; "
            f"raw (cross-entropy) loss {result['first']['raw'][0]:.6f}",
            flush=True,
        )

    print(
        f"\n{args.steps} timed steps after {args.warmup} warm-up, {args.threads} thread(s), median per step"
    )
    header = (
        f"{'config':<13}{'params':>9}{'samples':>8}{'tokens':>8}{'padded ours/trl':>17}{'mb ours/trl':>12}"
    )
    header += (
        f"{'ours s':>9}{'trl s':>9}{'raw s':>9}{'ours tok/s':>12}{'trl tok/s':>11}{'vs trl':>8}{'vs raw':>8}"
    )
    print(header)
    for r in results:
        main_mark = " (main)" if r["config"] == args.main else ""
        print(
            f"{r['config']:<13}{r['num_params'] / 1e6:>8.2f}M{r['num_samples']:>8}{r['num_tokens']:>8}"
            f"{r['padded']['ours']:>9}/{r['padded']['trl']:<7}{r['micro_batches']['ours']:>7}/{r['micro_batches']['trl']:<4}"
            f"{r['median_s']['ours']:>9.3f}{r['median_s']['trl']:>9.3f}{r['median_s']['raw']:>9.3f}"
            f"{r['tok_s']['ours']:>12.0f}{r['tok_s']['trl']:>11.0f}"
            f"{r['ratio_vs_trl']:>8.2f}{r['ratio_vs_raw']:>8.3f}{main_mark}"
        )
    main_result = next(r for r in results if r["config"] == args.main)
    print(f"ratio_vs_trl={main_result['ratio_vs_trl']:.2f} ratio_vs_raw={main_result['ratio_vs_raw']:.3f}")


if __name__ == "__main__":
    main()

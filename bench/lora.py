"""Benchmark: bytes published per step and trainer step time with LoRA, against full fine-tuning
of the same model in the same run.

Both sides are the real ``trainer.train.Trainer`` (one process, CPU) on the same model and the same
packed micro-batches: ``Trainer.step`` (forward, RL loss, backward, clipping, AdamW) followed by
``Trainer.publish`` (what reaches the inference server: the whole weights, or the adapter only).
The model is a Qwen3 built from a config with random weights (hidden ``--hidden``, ``--layers``
layers, vocabulary ``--vocab``) saved with a tokenizer to a temporary directory, so both trainers
load it as a run would. LoRA: rank ``--rank`` on every attention and MLP projection (the default
targets).

Bytes per step are the published files of one step (``adapter_model.safetensors`` +
``adapter_config.json``, or ``model.safetensors`` + ``config.json``; the manifest and marker are
the same few hundred bytes on both). Step time is the median over ``--steps`` steps after one
warm-up, the two trainers alternating step by step so that drift on a shared machine hits both.

The last line is ``bytes_ratio=X step_ratio=Y``: X = LoRA bytes / full bytes, Y = LoRA step time /
full step time (both lower is better).

Run::

    uv run python bench/lora.py
    uv run python bench/lora.py --hidden 256 --layers 2 --steps 3
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch

from prime_composer.config.trainer import TrainerConfig
from prime_composer.orchestrator.packing import pack_step
from prime_composer.orchestrator.sample import Sample
from prime_composer.trainer.model import World
from prime_composer.trainer.train import Trainer
from prime_composer.transport.batch import MicroBatch


def build_model_dir(args: argparse.Namespace, where: Path) -> Path:
    """A random Qwen3 of the requested size, with the tiny model's tokenizer, as a model directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    from prime_composer.model.resolve import resolve_model_name

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_name("builtin:tiny-qwen3"))
    config = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = where / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_micro_batches(args: argparse.Namespace, pad_token_id: int) -> list[MicroBatch]:
    """Random samples with off-policy logprobs near -log(vocab) and +-1 advantages, packed."""
    rng = random.Random(0)
    samples = []
    for i in range(args.num_samples):
        prompt = [rng.randrange(3, args.vocab) for _ in range(rng.randint(16, 48))]
        completion = [rng.randrange(3, args.vocab) for _ in range(rng.randint(8, 64))]
        samples.append(
            Sample(
                prompt_ids=prompt,
                completion_ids=completion,
                completion_logprobs=[-torch.log(torch.tensor(float(args.vocab))).item()] * len(completion),
                completion_mask=[1] * len(completion),
                reward=float(i % 2),
                advantage=1.0 if i % 2 else -1.0,
                example_id=i // 4,
                group_id=i // 4,
                policy_step=0,
            )
        )
    (micro_batches,), _ = pack_step(samples, args.seq_len, args.micro_batch_size, 1, pad_token_id)
    return micro_batches


def published_bytes(step_dir: Path) -> int:
    names = ("adapter_model.safetensors", "adapter_config.json", "model.safetensors", "config.json")
    return sum((step_dir / n).stat().st_size for n in names if (step_dir / n).is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    world = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))

    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        model_dir = build_model_dir(args, Path(tmp))
        trainers: dict[str, Trainer] = {}
        for side in ("full", "lora"):
            model: dict = {"name": str(model_dir), "dtype": "float32"}
            if side == "lora":
                model["lora"] = {"rank": args.rank, "alpha": 2.0 * args.rank}
            config = TrainerConfig.model_validate(
                {"model": model, "output_dir": str(Path(tmp) / side), "max_steps": args.steps + 1}
            )
            trainers[side] = Trainer(config, world)
        pad = trainers["full"].tokenizer.pad_token_id or 0
        micro_batches = make_micro_batches(args, pad)
        num_params = sum(p.numel() for p in trainers["full"].model.parameters())
        num_adapter = sum(p.numel() for p in trainers["lora"].model.parameters() if p.requires_grad)

        times: dict[str, list[float]] = {"full": [], "lora": []}
        sizes: dict[str, int] = {}
        for step in range(args.steps + 1):
            for side, trainer in trainers.items():
                began = time.perf_counter()
                metrics = trainer.step(micro_batches, step)
                trainer.publish(step + 1)
                elapsed = time.perf_counter() - began
                if step > 0:  # the first step warms up allocators and kernels
                    times[side].append(elapsed)
                sizes[side] = published_bytes(trainer.broadcast_root / f"step_{step + 1}")
                print(
                    f"{side:>4} step {step}: {elapsed:6.2f} s loss {metrics['loss/total']:+.4f}", flush=True
                )

    full_s, lora_s = statistics.median(times["full"]), statistics.median(times["lora"])
    num_tokens = sum(int(mb.loss_mask.sum()) for mb in micro_batches)
    print()
    print(
        f"model: Qwen3 hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}: {num_params / 1e6:.1f}M"
    )
    print(f"LoRA rank {args.rank} on every projection: {num_adapter / 1e6:.3f}M trained parameters")
    print(f"step: {len(micro_batches)} micro-batches, {num_tokens} loss tokens; {args.threads} thread(s)")
    print("| side | bytes published / step | step + publish (median s) |")
    print("| --- | --- | --- |")
    for side, seconds in (("full", full_s), ("lora", lora_s)):
        print(f"| {side} | {sizes[side]:,} | {seconds:.3f} |")
    print(f"bytes_ratio={sizes['lora'] / sizes['full']:.4f} step_ratio={lora_s / full_s:.3f}")


if __name__ == "__main__":
    main()

"""Benchmark: what SDPO costs the trainer step, against the same step without it, in one run.

Workload: one rank's packed step of synthetic rollouts (``--num-rows`` rows of ``--seq-len``
tokens, each sample ``--prompt-len`` prompt + ``--completion-len`` completion tokens), packed by
the real ``pack_step`` and trained by the real ``train_step`` + grad clip + AdamW step + teacher
update, on a randomly initialised Qwen3 (``--preset``). A hinted sample's teacher context is its
prompt + ``--hint-len`` hint tokens; its target is the whole completion. Three cases:

- ``base``: ``loss.sdpo.weight = 0`` (no teacher model, no teacher forward);
- ``all``: weight 0.1, every sample hinted;
- ``30``: weight 0.1, 30% of the samples hinted (spread evenly).

Step time: the three cases are built in this process and their steps interleaved (base, all, 30,
base, ...) for ``--steps`` rounds after a warm-up, so load from other processes on a shared machine
hits them alike; the median per case is reported. Peak memory: each case runs in its own fresh
process (so peaks do not mix): on a GPU ``torch.cuda.max_memory_allocated`` over two steps after a
warm-up, on a CPU the peak resident set size over those steps (``VmHWM`` after resetting it) minus
the resident size before the model was built (large allocations are mmapped, see
``MALLOC_MMAP_THRESHOLD_``, so freed tensors leave the resident set). Both include weights,
optimizer state, the EMA teacher copy and activations.

The last line is ``overhead_all=X overhead_30=Y``, each the larger of the step-time ratio and the
peak-memory ratio against ``base`` (targets: X <= 1.5, Y <= 1.12 on the small preset); the line before gives both ratios.

Run::

    uv run python bench/sdpo.py                              # CPU: tiny preset
    uv run python bench/sdpo.py --preset small --device cuda # GPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

PRESETS: dict[str, dict[str, int]] = {
    # The builtin tiny model's shape (random weights here).
    "tiny": dict(vocab_size=461, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=64),
    # ~60M parameters with a 32k vocabulary.
    "small": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64),
    # ~0.5B parameters with Qwen's 152k vocabulary (a GPU workload).
    "medium": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=24,
                   num_attention_heads=16, num_key_value_heads=8, head_dim=64),
}  # fmt: skip

CASES = {"base": (0.0, 0.0), "all": (0.1, 1.0), "30": (0.1, 0.3)}
"""Case -> (loss.sdpo.weight, fraction of samples hinted)."""


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM to the current RSS (Linux >= 4.0)
        f.write("5")


def make_samples(args: argparse.Namespace, hinted_fraction: float, vocab: int) -> list:
    import random

    from prime_composer.orchestrator.sample import Sample
    from prime_composer.orchestrator.sdpo.target import set_sdpo_target

    rng = random.Random(0)
    per_row = max(1, args.seq_len // (args.prompt_len + args.completion_len))
    samples = []
    for i in range(args.num_rows * per_row):
        prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
        completion = [rng.randrange(3, vocab) for _ in range(args.completion_len)]
        s = Sample(
            prompt_ids=prompt,
            completion_ids=completion,
            completion_logprobs=[-1.0] * len(completion),
            completion_mask=[1] * len(completion),
            reward=float(i % 2),
            example_id=i,
            group_id=i // 8,
            policy_step=0,
            advantage=1.0 if i % 2 else -1.0,
        )
        # Evenly spread: sample i is hinted when floor(f * (i + 1)) > floor(f * i).
        if math.floor(hinted_fraction * (i + 1) + 1e-9) > math.floor(hinted_fraction * i + 1e-9):
            hint = [rng.randrange(3, vocab) for _ in range(args.hint_len)]
            set_sdpo_target(s, (0, len(completion)), prompt + hint)
        samples.append(s)
    return samples


def build_case(args: argparse.Namespace, case: str) -> Callable[[], None]:
    """Model, optimizer, teacher and packed step of ``case``; returns a function running one step."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from prime_composer.config.loss import LossConfig, SDPOLossConfig
    from prime_composer.config.optim import OptimConfig
    from prime_composer.orchestrator.packing import pack_step
    from prime_composer.orchestrator.sdpo.packing import SDPOPacker
    from prime_composer.orchestrator.sdpo.target import sdpo_target
    from prime_composer.trainer.losses.base import TermContext, build_terms
    from prime_composer.trainer.optim import build_optimizer, clip_grad_norm
    from prime_composer.trainer.step import train_step

    device = torch.device(args.device)
    weight, fraction = CASES[case]
    shape = PRESETS[args.preset]
    samples = make_samples(args, fraction, shape["vocab_size"])
    (micro_batches,), _ = pack_step(
        samples, args.seq_len, args.micro_batch_size, 1, pad_token_id=0, packers=[SDPOPacker()]
    )
    torch.manual_seed(0)
    config = Qwen3Config(
        **shape, max_position_embeddings=max(1024, 2 * args.seq_len), tie_word_embeddings=True
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = Qwen3ForCausalLM(config).to(device=device, dtype=dtype)
    model.config._attn_implementation = "sdpa"
    model.train()
    loss_cfg = LossConfig(sdpo=SDPOLossConfig(weight=weight, teacher=args.teacher))
    context = TermContext(model)
    terms = build_terms(loss_cfg, context)  # weight 0: no SDPO term, no teacher copy
    optimizer, _ = build_optimizer(model, OptimConfig(lr=1e-5), 10_000)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        train_step(model, micro_batches, terms, device)
        clip_grad_norm(model, 1.0)
        optimizer.step()
        context.after_optimizer_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    num_hinted = sum(sdpo_target(s) is not None for s in samples)
    step.info = (  # type: ignore[attr-defined]
        f"hinted {num_hinted}/{len(samples)}, teacher rows "
        f"{sum(g.teacher_input_ids.shape[0] for mb in micro_batches if (g := mb.groups.get('sdpo')) is not None)}, student rows "
        f"{sum(mb.input_ids.shape[0] for mb in micro_batches)}"
    )
    return step


def peak_memory_mib(args: argparse.Namespace) -> float:
    """Child mode: peak memory of ``args.case``'s steps, from before the model exists."""
    import torch

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else _rss_kib("VmRSS")
    step = build_case(args, args.case)
    step()  # warm-up: optimizer state, allocator pools
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        _reset_peak_rss()
    for _ in range(2):
        step()
    if device.type == "cuda":
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    return (_rss_kib("VmHWM") - before) / 1024


def step_times(args: argparse.Namespace) -> dict[str, float]:
    """Median step time of every case, measured in this process with the cases' steps interleaved
    (base, all, 30, base, ...), so load from other processes hits them alike."""
    import torch

    torch.set_num_threads(args.threads)
    steps = {case: build_case(args, case) for case in CASES}
    for case, step in steps.items():
        step()  # warm-up
        print(f"# {case}: {step.info}", flush=True)  # type: ignore[attr-defined]
    times: dict[str, list[float]] = {case: [] for case in CASES}
    for _ in range(args.steps):
        for case, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[case].append(time.perf_counter() - t0)
    return {case: statistics.median(t) for case, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--device", default="cuda" if _has_cuda() else "cpu")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--num-rows", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=96)
    parser.add_argument("--completion-len", type=int, default=128)
    parser.add_argument("--hint-len", type=int, default=32)
    parser.add_argument("--teacher", choices=["live", "ema", "frozen"], default="ema")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--case", choices=sorted(CASES), help=argparse.SUPPRESS)  # child mode
    args = parser.parse_args()
    if args.case:
        print(json.dumps({"peak_mib": peak_memory_mib(args)}))
        return

    print(f"# preset={args.preset} device={args.device} seq_len={args.seq_len} rows={args.num_rows} "
          f"micro_batch_size={args.micro_batch_size} teacher={args.teacher} steps={args.steps}", flush=True)  # fmt: skip
    peaks = {}
    # Large allocations as their own mappings, returned to the OS when freed: RSS then follows the
    # live tensors instead of glibc's heap high-water mark.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    for case in CASES:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--case", case]
        out = (
            subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
            .stdout.strip()
            .splitlines()[-1]
        )
        peaks[case] = json.loads(out)["peak_mib"]
    times = step_times(args)
    for case in CASES:
        print(f"{case:>4}: step {times[case] * 1e3:9.1f} ms   peak memory {peaks[case]:9.1f} MiB", flush=True)
    ratios = {case: (times[case] / times["base"], peaks[case] / peaks["base"]) for case in ("all", "30")}
    print(" ".join(f"time_{c}={t:.3f} mem_{c}={m:.3f}" for c, (t, m) in ratios.items()))
    print(f"overhead_all={max(ratios['all']):.3f} overhead_30={max(ratios['30']):.3f}")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()

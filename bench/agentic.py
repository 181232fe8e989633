"""Benchmark: what the sandbox adds to a tool call and to a test run, against the same command
bare; and how many agentic episodes per minute the rollout stage plays.

For each command the bench alternates a bare run and a sandboxed run of it, ``--reps`` times:

    bare       subprocess.run(argv, cwd=<workspace>, env=<the sandbox's environment>,
               capture_output=True), as this process's user, no isolation
    sandboxed  Sandbox.run(workspace, argv): namespaces, uid, mounts, rlimits, output capture

and reports the medians and the median of the paired differences (``overhead``). Commands:
``true`` and ``python -c pass`` (what a tool call costs at least), ``bash -c true`` through
``Toolset.call("run", ...)`` (a whole tool call as the model makes it: argument parsing, the run,
formatting), and ``python -m pytest`` on a small generated suite (a test run). Alternating bare
and sandboxed runs keeps the machine's load changes out of the differences.

Episodes per minute: ``RolloutRunner.run_group`` plays pyfix episodes (the agent harness, the
sandbox, verifiers' rollout machinery, the grader) against the scripted oracle of
``pyfix.scripted`` (token-in server on 127.0.0.1, in a thread of this process; its work per call is
a decode and an encode), 16 at a time, each on another task: five model calls, four tool calls
(two test runs) and a grading test run per episode. The baseline is the same episodes one at a
time, so the ratio shows what concurrency buys. Every episode must earn reward 1, else the bench
fails.

The last line is ``sandbox_overhead_ms=X episodes_per_min=Y``: X is the largest of the median
overheads (target X <= 50), Y the median over ``--episode-reps`` rounds of 16 concurrent episodes.

Run (as root, so runs are isolated; ~2 min on 2 shared cores)::

    uv run python bench/agentic.py
    uv run python bench/agentic.py --reps 50 --pytest-reps 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from prime_composer.config.env import EnvConfig, RolloutConfig, SamplingConfig
from prime_composer.config.sandbox import SandboxConfig, ToolsConfig
from prime_composer.sandbox import Sandbox, Toolset, Workspace

PYTEST = ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider"]


def write_suite(folder: Path, num_tests: int) -> None:
    (folder / "mathlib.py").write_text("def add(a, b):\n    return a + b\n")
    tests = "".join(f"\n\ndef test_add_{i}():\n    assert add({i}, 1) == {i + 1}\n" for i in range(num_tests))
    (folder / "test_mathlib.py").write_text("from mathlib import add\n" + tests)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def measure(
    name: str, bare: Callable[[], object], sandboxed: Callable[[], object], reps: int
) -> dict[str, float | str]:
    bare(), sandboxed()  # warm caches on both sides
    bare_ms, sandbox_ms = [], []
    for _ in range(reps):
        bare_ms.append(timed(bare))
        sandbox_ms.append(timed(sandboxed))
    diffs = sorted(s - b for s, b in zip(sandbox_ms, bare_ms, strict=True))
    return {
        "command": name,
        "bare_ms": statistics.median(bare_ms),
        "sandbox_ms": statistics.median(sandbox_ms),
        "overhead_ms": statistics.median(diffs),
        "overhead_p90_ms": diffs[int(0.9 * (len(diffs) - 1))],
    }


def bare_run(workspace: Workspace, env: dict[str, str], argv: list[str]) -> Callable[[], object]:
    def run() -> None:
        completed = subprocess.run(argv, cwd=workspace.path, env=env, capture_output=True)
        if completed.returncode != 0:
            raise SystemExit(f"bench: bare {argv} failed: {completed.stderr.decode()[-500:]}")

    return run


def sandboxed_run(
    sandbox: Sandbox, workspace: Workspace, argv: list[str], test: bool
) -> Callable[[], object]:
    limits = sandbox.config.test_limits if test else sandbox.config.limits

    def run() -> None:
        result = sandbox.run(workspace, argv, limits=limits)
        if result.exit_code != 0:
            raise SystemExit(f"bench: sandboxed {argv} failed: {result.stderr[-500:]}")

    return run


def bench_episodes(num_concurrent: int, reps: int, allow_unisolated: bool) -> dict[str, float]:
    """Episodes per minute of ``num_concurrent`` concurrent scripted episodes, and one at a time."""
    from transformers import AutoTokenizer

    from prime_composer.model.resolve import resolve_model_name
    from prime_composer.orchestrator import envs
    from prime_composer.orchestrator.rollout import RolloutRunner

    tokenizer = resolve_model_name("builtin:tiny-qwen3")
    agent = {"tokenizer": tokenizer, "sandbox": {"allow_unisolated": allow_unisolated}}
    loaded = envs.load_env(EnvConfig(id="pyfix", agent=agent), 0)  # puts pyfix on sys.path
    from pyfix.scripted import ScriptedServer

    tasks = loaded.tasks()
    server = ScriptedServer(AutoTokenizer.from_pretrained(tokenizer), [t.data for t in tasks])

    async def play(base_url: str, indices: list[int], concurrency: int) -> float:
        async with RolloutRunner(
            [loaded],
            base_url=base_url,
            model="oracle",
            sampling=SamplingConfig(max_tokens=256),
            rollout=RolloutConfig(max_concurrent=concurrency),
        ) as runner:
            await runner.run_group(loaded, tasks[0], group_size=1, example_id=0, group_id=0, policy_step=0)
            start = time.perf_counter()
            groups = await asyncio.gather(
                *(
                    runner.run_group(
                        loaded, tasks[i % len(tasks)], group_size=1, example_id=i, group_id=i, policy_step=0
                    )
                    for i in indices
                )
            )
            elapsed = time.perf_counter() - start
        bad = [s.error or f"reward {s.reward}" for g in groups for s in g if s.error or s.reward != 1.0]
        if bad:
            raise SystemExit(f"bench: scripted oracle episodes failed: {bad[:3]}")
        return len(indices) / elapsed * 60

    indices = list(range(num_concurrent))
    with server.serve() as base_url:
        concurrent = [asyncio.run(play(base_url, indices, num_concurrent)) for _ in range(reps)]
        sequential = asyncio.run(play(base_url, indices, 1))
    return {"concurrent": statistics.median(concurrent), "sequential": sequential}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=30, help="runs of each side per fast command")
    parser.add_argument("--pytest-reps", type=int, default=15, help="runs of each side of the pytest suite")
    parser.add_argument("--num-tests", type=int, default=20, help="tests in the generated suite")
    parser.add_argument(
        "--allow-unisolated", action="store_true", help="measure even where runs cannot be isolated"
    )
    parser.add_argument("--episodes", type=int, default=16, help="concurrent scripted episodes")
    parser.add_argument("--episode-reps", type=int, default=3, help="rounds of concurrent episodes")
    parser.add_argument("--json", type=Path, help="also write the table here")
    args = parser.parse_args()

    config = SandboxConfig(allow_unisolated=args.allow_unisolated)
    with Sandbox(config) as sandbox, tempfile.TemporaryDirectory() as source:
        write_suite(Path(source), args.num_tests)
        with sandbox.workspace(source) as workspace:
            env = sandbox.environment(workspace)
            tools = Toolset(sandbox, workspace, ToolsConfig(enabled=["run"]))

            def tool_call() -> None:
                result = tools.call("run", json.dumps({"command": "true"}))
                if not result.record.ok:
                    raise SystemExit(f"bench: tool call failed: {result.content}")

            rows = [
                measure(
                    "true",
                    bare_run(workspace, env, ["true"]),
                    sandboxed_run(sandbox, workspace, ["true"], False),
                    args.reps,
                ),
                measure(
                    "python -c pass",
                    bare_run(workspace, env, ["python", "-c", "pass"]),
                    sandboxed_run(sandbox, workspace, ["python", "-c", "pass"], False),
                    args.reps,
                ),
                measure(
                    "tool call run(true)",
                    bare_run(workspace, env, ["bash", "-c", "true"]),
                    tool_call,
                    args.reps,
                ),
                measure(
                    f"pytest ({args.num_tests} tests)",
                    bare_run(workspace, env, PYTEST),
                    sandboxed_run(sandbox, workspace, PYTEST, True),
                    args.pytest_reps,
                ),
            ]
        isolated = sandbox.isolated

    print(f"sandbox isolated: {isolated}; python: {sys.executable}")
    print(f"{'command':<24} {'bare ms':>9} {'sandbox ms':>11} {'overhead ms':>12} {'p90 ms':>8}")
    for row in rows:
        print(
            f"{row['command']:<24} {row['bare_ms']:>9.1f} {row['sandbox_ms']:>11.1f} "
            f"{row['overhead_ms']:>12.1f} {row['overhead_p90_ms']:>8.1f}"
        )
    episodes = bench_episodes(args.episodes, args.episode_reps, args.allow_unisolated)
    print(
        f"episodes/min: {args.episodes} concurrent {episodes['concurrent']:.0f}, one at a time "
        f"{episodes['sequential']:.0f} (x{episodes['concurrent'] / episodes['sequential']:.2f})"
    )
    if args.json:
        args.json.write_text(json.dumps({"isolated": isolated, "rows": rows, "episodes": episodes}, indent=2))
    overhead = max(float(row["overhead_ms"]) for row in rows)
    print(f"sandbox_overhead_ms={overhead:.1f} episodes_per_min={episodes['concurrent']:.0f}")


if __name__ == "__main__":
    main()

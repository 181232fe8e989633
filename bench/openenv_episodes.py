"""Benchmark: episodes per minute of an OpenEnv environment through the orchestrator's rollout
stage, against the same game played in-process by our own agent harness.

Both sides play the guess game (``tests/integration/openenv_envs.py``'s ``GuessEnv``: guess
``"abc"[seed % 3]`` in at most 3 tries; seeds 0, 1, 2 take 1, 2 and 3 turns) with the same
scripted token-in policy (guesses a, b, c in turn; ``bench/_guess_local.py``, a decode and an
encode per call, in a thread of this process), through ``RolloutRunner.run_group`` (verifiers'
rollout machinery, the agent harness and loop, Samples):

    openenv    an ``[[orchestrator.env]]`` with ``openenv.app = "openenv_envs:guess_app"``: the
               OpenEnv server (uvicorn on 127.0.0.1, served by ``openenv_env.serve_app``), one
               WebSocket session per episode (/schema, connect, reset, a step per guess)
    harness    ``bench/_guess_local.py``'s taskset: the same game as an in-process
               ``ExternalEnvironment`` of the agent loop, nothing over the network

Each round plays ``--episodes`` episodes (cycling the seeds), ``--concurrency`` at a time, on
each side in turn (alternating, so load changes hit both); every episode must earn reward 1.
The last line is ``openenv_episodes_per_min=X harness_episodes_per_min=Y ratio=X/Y`` (medians
over ``--rounds``).

Run (~1 min on 2 shared cores)::

    uv run python bench/openenv_episodes.py
    uv run python bench/openenv_episodes.py --episodes 96 --concurrency 16 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

from prime_composer.config.env import EnvConfig, RolloutConfig, SamplingConfig
from prime_composer.model.resolve import resolve_model_name
from prime_composer.orchestrator import envs
from prime_composer.orchestrator.rollout import RolloutRunner

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from _guess_local import GuessPolicy  # noqa: E402


async def play(loaded: envs.LoadedEnv, base_url: str, episodes: int, concurrency: int) -> float:
    """Seconds to play ``episodes`` episodes, ``concurrency`` at a time; checks every reward."""
    tasks = loaded.tasks()
    limit = asyncio.Semaphore(concurrency)
    async with RolloutRunner(
        [loaded],
        base_url=base_url,
        model="guess",
        sampling=SamplingConfig(max_tokens=8),
        rollout=RolloutConfig(max_concurrent=concurrency),
    ) as runner:

        async def one(i: int) -> float:
            async with limit:
                (sample,) = await runner.run_group(
                    loaded, tasks[i % len(tasks)], group_size=1, example_id=i, group_id=i, policy_step=0
                )
            if sample.error is not None or sample.reward != 1.0:
                raise RuntimeError(
                    f"{loaded.label} episode {i}: reward {sample.reward}, error {sample.error}"
                )
            return sample.reward

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(episodes)))
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--episodes", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    tokenizer_path = resolve_model_name("builtin:tiny-qwen3")
    agent = {"tokenizer": tokenizer_path, "max_turns": 4, "time_limit_s": 60, "render_tools": False}
    seeds = [{"seed": s} for s in range(3)]
    source = {
        "app": "openenv_envs:guess_app",
        "app_dir": str(REPO / "tests" / "integration"),
        "resets": seeds,
        "describe_action": False,  # the same first turn as the harness side
    }
    openenv = envs.load_env(EnvConfig(name="openenv", openenv=source, agent=agent), 0)
    harness = envs.load_env(
        EnvConfig(id="_guess_local", name="harness", agent=agent), 1, env_dirs=[REPO / "bench" / "none"]
    )
    policy = GuessPolicy(AutoTokenizer.from_pretrained(tokenizer_path))
    rates: dict[str, list[float]] = {"openenv": [], "harness": []}
    with policy.serve() as base_url:
        asyncio.run(play(openenv, base_url, 3, 3))  # warm: server, imports, tokenizer
        asyncio.run(play(harness, base_url, 3, 3))
        for _ in range(args.rounds):
            for name, loaded in (("openenv", openenv), ("harness", harness)):
                seconds = asyncio.run(play(loaded, base_url, args.episodes, args.concurrency))
                rates[name].append(60.0 * args.episodes / seconds)
    print(
        f"{args.episodes} episodes per round (1-3 turns each), {args.concurrency} at a time, {args.rounds} rounds"
    )
    for name, values in rates.items():
        print(
            f"{name:<8} episodes/min: median {statistics.median(values):.0f} (rounds: {', '.join(f'{v:.0f}' for v in values)})"
        )
    x, y = statistics.median(rates["openenv"]), statistics.median(rates["harness"])
    print(f"openenv_episodes_per_min={x:.0f} harness_episodes_per_min={y:.0f} ratio={x / y:.2f}")


if __name__ == "__main__":
    main()

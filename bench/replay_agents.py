"""Real agent episodes for ``bench/replay.py``: scripted pyfix agents of different skill that run
their tools in the sandbox, exported as the teacher's traces by the project's one converter.

Agents (``environments/pyfix/pyfix/scripted.py``), one per task in turn:

- ``oracle``: run the tests, read, fix, re-run, answer (reward 1; no mistake);
- ``wrong_fix``: the oracle's episode with a wrong edit at turn 2; the re-run fails;
- ``bad_edit``: an edit whose ``old_string`` is not in the file at turn 0 (a tool error), then
  gives up;
- ``noop``: answers "looks fine" at turn 0 without running anything.

Each episode really runs: the agent harness calls a token-in server on 127.0.0.1, the tool calls
run in the sandbox (``pytest`` included), and ``trace_export.samples_to_traces`` turns the
Samples into the records the service imports. The *first wrong step* of a non-oracle episode is
its mistake, and the right action there is the oracle's action at the same turn of the same task
(the later steps of a failed episode count as ordinary ones, as in Step-DPO). The scripted
logprobs depend only on the token position, so these traces carry no uncertainty signal.

    records, planted = agent_traces(num_tasks=36)
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ALTERNATIVES = [
    {"tool": "read_file", "arguments": {"path": "test_calc.py"}},
    {"tool": "read_file", "arguments": {"path": "calc.py"}},
    {"tool": "run_tests", "arguments": {}},
]
"""What a teacher that is wrong says instead, in pyfix's own tools."""
AGENTS = ("oracle", "wrong_fix", "bad_edit", "noop")
MISTAKE_TURN = {"wrong_fix": 2, "bad_edit": 0, "noop": 0}
"""The first wrong step of each agent (its k-th assistant turn)."""
SECRET_VAR = "PC_BENCH_SCRIPTED_SECRET"


def _action(turn: dict[str, Any]) -> dict[str, Any]:
    calls = turn.get("tool_calls") or []
    if calls:
        arguments = calls[0]["arguments"]
        return {
            "tool": calls[0]["name"],
            "arguments": json.loads(arguments) if isinstance(arguments, str) else arguments,
        }
    return {"message": turn.get("content") or ""}


def agent_traces(num_tasks: int) -> tuple[list[dict[str, Any]], dict[tuple[str, int], dict[str, Any]]]:
    """``num_tasks`` episodes (agents in turn over the pyfix train tasks, at most two passes) as
    trace records, and
    ``(trace id, turn index) -> right action`` at each episode's first wrong step."""
    sys.path.insert(0, str(REPO / "environments" / "pyfix"))
    from pyfix.scripted import ScriptedServer
    from transformers import AutoTokenizer

    from prime_composer.config.env import EnvConfig, RolloutConfig, SamplingConfig
    from prime_composer.model.resolve import resolve_model_name
    from prime_composer.orchestrator import envs
    from prime_composer.orchestrator.rollout import RolloutRunner
    from prime_composer.orchestrator.trace_export import samples_to_traces

    tokenizer = resolve_model_name("builtin:tiny-qwen3")
    root = Path(tempfile.mkdtemp(prefix="pc-replay-agents-", dir="/var/lib" if os.geteuid() == 0 else None))
    # Scripted agents are trusted code: run them unisolated where isolation is impossible.
    sandbox = {"root_dir": str(root)} if os.geteuid() == 0 else {"allow_unisolated": True}
    # pyfix as configs/quickstart-agentic.toml plays it (the tools described in the system prompt's
    # one line, not as the template's JSON schemas): the agents_llm teachers are that config's
    # warm-ups, trained on exactly this context.
    agent = {
        "tokenizer": tokenizer, "max_turns": 6, "time_limit_s": 120, "sandbox": sandbox,
        "render_tools": False, "max_context_tokens": 1024,
    }  # fmt: skip
    env = envs.load_env(EnvConfig(id="pyfix", agent=agent), 0)
    tasks = env.tasks("train")
    if num_tasks > 2 * len(tasks):
        raise ValueError(
            f"--agent-tasks {num_tasks}: pyfix has {len(tasks)} train tasks (x 2 passes at most)"
        )
    # Task t is played by agent t (mod 4) in the first pass and by agent t + 1 in the second, so
    # no (agent, task) episode repeats, whatever the number of tasks.
    plays = [
        (AGENTS[(i % len(tasks) + i // len(tasks)) % len(AGENTS)], i % len(tasks)) for i in range(num_tasks)
    ]
    # The oracle of every task played, for the right action at the others' mistakes.
    needed = sorted({t for _, t in plays} - {t for a, t in plays if a == "oracle"})
    jobs = plays + [("oracle", t) for t in needed]
    server = ScriptedServer(AutoTokenizer.from_pretrained(tokenizer), [t.data for t in tasks], secret="bench")
    os.environ[SECRET_VAR] = "bench"

    async def play(base_url: str, name: str, indices: list[int]) -> list[Any]:
        async with RolloutRunner(
            [env],
            base_url=base_url,
            model=name,  # the scripted server picks the agent by the request's model
            sampling=SamplingConfig(max_tokens=200),
            rollout=RolloutConfig(max_concurrent=4),
            api_key_var=SECRET_VAR,
        ) as runner:
            return await asyncio.gather(
                *(
                    runner.run_group(
                        env, tasks[jobs[n][1]], group_size=1, example_id=n, group_id=n, policy_step=0
                    )
                    for n in indices
                )
            )

    async def main(base_url: str) -> list[Any]:
        by_agent = {name: [n for n, (a, _) in enumerate(jobs) if a == name] for name in AGENTS}
        # One runner at a time: a runner's close shuts the env's shared clients down.
        played = [await play(base_url, name, ns) for name, ns in by_agent.items()]
        groups: list[Any] = [None] * len(jobs)
        for ns, gs in zip(by_agent.values(), played, strict=True):
            for n, g in zip(ns, gs, strict=True):
                groups[n] = g
        return groups

    try:
        with server.serve() as base_url:
            groups = asyncio.run(main(base_url))
    finally:
        del os.environ[SECRET_VAR]
        shutil.rmtree(root, ignore_errors=True)
    errors = [g[0].error for g in groups if g[0].error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} agent episodes failed, first: {errors[0]}")
    records = [samples_to_traces(group)[0] for group in groups]
    oracle = {t: records[n] for n, (name, t) in enumerate(jobs) if name == "oracle"}
    planted: dict[tuple[str, int], dict[str, Any]] = {}
    out = []
    for n, (name, t) in enumerate(plays):
        record = {**records[n], "id": f"{name}-{n:03d}"}
        out.append(record)
        if name in MISTAKE_TURN:
            k = MISTAKE_TURN[name]
            turn_index = [i for i, turn in enumerate(record["turns"]) if turn["role"] == "assistant"][k]
            right_turn = [turn for turn in oracle[t]["turns"] if turn["role"] == "assistant"][k]
            planted[(record["id"], turn_index)] = _action(right_turn)
    return out, planted

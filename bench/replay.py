"""Benchmark: what the VOI gate + cascade save in teacher calls and dollars, and what recall of
planted errors they keep, against asking every teacher at every step, in one run.

Workload: ``--num-traces`` synthetic coding-agent traces (read the tree, run the failing tests,
read the module, edit, re-run, answer), with long tool outputs so the context grows step by step
like a real agent's. In ``--planted`` of them one step is a planted mistake of one of four kinds:

- ``wrong_edit``: an edit that does not fix the bug; the next test run fails;
- ``edit_tests``: the agent edits the test instead of the code; the tests then pass (silent);
- ``give_up``: the agent answers "done" right after a failing run;
- ``revert``: the agent reverts its correct edit (``git checkout``), then answers.

The student's uncertainty comes from logprobs drawn per action token: mean ``-0.15`` at ordinary
steps, ``-0.6`` at planted ones, both with wide noise (the ranges overlap); ``--no-uncertainty``
draws them all from one distribution. Teachers are three fake OpenAI-compatible endpoints on
loopback (``teacher.fakes``) with the prices of three frontier models (``PRICES``, per 1M tokens)
that answer from an oracle: at a planted step the right action with probability ``accuracy``
(else the trace's mistake or a random alternative); at an ordinary step the trace's own action
with probability ``agreement`` (else one of a few alternatives, so teachers sometimes agree on a
spurious pair). Answers are a deterministic function of (teacher, state), so the two runs see the
same teachers; usage is ~4 characters per token.

Every run uses the real ``Replayer`` (plan, cascade, ``TeacherPool``: cache, budget, ledger,
``teacher.calls``) on a fresh store, with no budget caps (the gate is measured, not the caps):

- ``all``: ``gate.enabled = false``, ``gate.cascade = false``: every step, every teacher;
- ``all+cascade``: every step, the cheapest teacher first (the others on disagreement or
  uncertainty), so the cascade's share of the saving is seen apart from the gate's;
- ``random+cascade``: B steps per trace drawn at random, with the cascade (the baseline of the gate);
- ``gate+cascade``: the heuristic gate (B = ``--max-steps-per-trace``) with the cascade;
- ``calibrated+cascade``: ``gate.model = "calibrated"`` (``teacher/voi.py``), learning online;
- ``proximity+cascade`` (asked by name, ``--runs``): the heuristic gate with
  ``gate.error_attribution = "proximity"``, the gate before failures were blamed on their cause
  (a failing test run marked itself, not the edit before it).

Variants (``--variants``): ``default``; ``confident`` (mistakes as confident as every other step:
logprobs carry no signal); ``together`` (the teachers' errors are one draw per state, so a wrong
majority is unanimous and its pair gets no label smoothing); ``late_test`` (no failing test run
first: the trace reads before it runs the tests); ``agents`` (real episodes, not synthetic:
``bench/replay_agents.py`` plays ``--agent-tasks`` pyfix tasks with scripted agents of four skills,
oracle, wrong fix, bad edit and no-op, whose tools really run in the sandbox, and exports them with
the project's one converter, ``trace_export.samples_to_traces``; the mistake is each failed
episode's first wrong step, the right action the oracle's at that turn, and the teachers answer
from that oracle as above with pyfix's own tools as their wrong alternatives); ``agents_weak`` (the
same episodes, weaker teachers: ``WEAK_ACCURACY``); ``agents_llm`` (the same episodes, real local
teachers instead of oracles: two models of the agentic quickstart's family fine-tuned on its oracle
episodes, ``strong`` for ``--llm-strong-steps`` SFT steps priced like ``frontier-a`` and ``weak`` for
``--llm-weak-steps`` priced like ``frontier-c``, served by the embedded inference server and asked
as agents, ``protocol = "agent"`` with ``send_token_ids``: each plays the next turn from the
student's exact context tokens; built once
with ``rl --warmup.only`` into ``--llm-dir`` and reused; asked by name only, as building them takes
minutes). The
scripted agents' logprobs depend only on
the token position: the real traces carry no uncertainty signal. ``--agent-tasks`` defaults to 20,
pyfix's train tasks, each played once; up to 40 plays each task a second time with the next agent,
so no (agent, task) episode repeats. The episodes are played once per invocation and replayed for
every seed and variant.

Seeds (``--seed``, one or more): a seed draws the synthetic traces and salts the teachers' draws and
the random-B baseline's choice (seed 0 draws as before the seed reached the teachers); the agents
variants' episodes are the same for every seed. With several seeds a table of the gate's recall
over random B's per variant follows: mean, standard deviation, min and max.

Recall and precision are absolute: a planted step is *recalled* when it becomes a pair whose chosen
side is the right action (over all planted steps); precision is the share of pairs whose chosen
side is right. For the agents variants each teacher's accuracy is printed from the run that asks
every teacher at every step: at the planted steps, the share of its answers that are the right
action, and at the oracle's episodes, the share that agree with the oracle. ``gate ECE`` is the
expected calibration error of the score that ranked the steps
against their labels (``store.gate_calibration``). The last line is, per variant, the gate's recall
over random B's (both with the cascade, same B; the mean over the seeds).

Run::

    uv run python bench/replay.py
    uv run python bench/replay.py --num-traces 200 --seed 1 --variants default together
    uv run python bench/replay.py --variants agents agents_weak --agent-tasks 40
    uv run python bench/replay.py --variants agents agents_weak --max-steps-per-trace 2 --seed 0 1 2 3 4 \
        --runs all all+cascade random+cascade proximity+cascade gate+cascade calibrated+cascade
    uv run python bench/replay.py --variants agents_llm --max-steps-per-trace 2 --seed 0 1 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prime_composer.config.inference import InferenceConfig
from prime_composer.config.ports import free_port
from prime_composer.config.teacher import TeacherServiceConfig, TraceSourceConfig
from prime_composer.inference.local import running_app
from prime_composer.teacher.budget import Budget
from prime_composer.teacher.fakes import fake_teacher_app
from prime_composer.teacher.gate import step_features
from prime_composer.teacher.pool import TeacherPool
from prime_composer.teacher.prompts import prompt_hash, teacher_messages
from prime_composer.teacher.replay import Replayer
from prime_composer.teacher.store import PlannedStep, TeacherStore
from prime_composer.teacher.traces import Trace, parse_trace

PRICES = {  # USD per 1M input / output tokens, cheapest last
    "frontier-a": (3.00, 15.00),
    "frontier-b": (1.25, 10.00),
    "frontier-c": (0.30, 2.50),
}
ACCURACY = {"frontier-a": 0.92, "frontier-b": 0.90, "frontier-c": 0.80}
WEAK_ACCURACY = {"frontier-a": 0.70, "frontier-b": 0.65, "frontier-c": 0.55}
"""The weaker teachers of the ``agents_weak`` variant."""
AGREEMENT = 0.85
KINDS = ("wrong_edit", "edit_tests", "give_up", "revert")
ALTERNATIVES = [
    {"tool": "bash", "arguments": {"command": "git status"}},
    {"tool": "bash", "arguments": {"command": "ls -la"}},
    {"tool": "bash", "arguments": {"command": "pytest -q -x"}},
]


def bash(command: str) -> dict[str, Any]:
    return {"tool": "bash", "arguments": {"command": command}}


def edit(path: str, old: str, new: str) -> dict[str, Any]:
    return {"tool": "str_replace", "arguments": {"path": path, "old_str": old, "new_str": new}}


def message(text: str) -> dict[str, Any]:
    return {"message": text}


@dataclass
class Step:
    action: dict[str, Any]
    result: str | None
    exit_code: int | None = None
    right: dict[str, Any] | None = None
    """The right action, for a planted mistake."""


def module_text(rng: random.Random, i: int) -> str:
    lines = [f'"""Module {i}: helpers for the accounting service."""', "", "import math", ""]
    for f in range(rng.randint(12, 24)):
        lines += [
            f"def helper_{f}(x, y):",
            f'    """Helper {f} combines two values."""',
            f"    return x * {f} + y",
            "",
        ]
    lines += ["def total(a, b):", '    """Sum of two amounts."""', "    return a - b", ""]
    return "\n".join(lines)


def make_trace(
    i: int, rng: random.Random, plant: str | None, informative: bool, first_fail: bool = True
) -> tuple[dict[str, Any], int | None, dict[str, Any] | None]:
    """A trace, the turn index of its planted step and the right action there (None, None)."""
    mod, test = f"pkg{i}/ledger.py", f"pkg{i}/test_ledger.py"
    fail = f"FAILED {test}::test_total - assert -1 == 5\n1 failed, {rng.randint(3, 9)} passed in 0.{rng.randint(10, 99)}s"
    ok = f"{rng.randint(4, 10)} passed in 0.{rng.randint(10, 99)}s"
    fix = edit(mod, "return a - b", "return a + b")
    steps = [
        Step(bash(f"ls pkg{i}"), "ledger.py\ntest_ledger.py\nREADME.md", 0),
        Step(bash("pytest -q"), fail, 1),
        Step(bash(f"cat {mod}"), module_text(rng, i), 0),
        Step(bash(f"grep -n total {test}"), "12:    assert total(2, 3) == 5", 0),
    ]
    if not first_fail:  # the agent reads before it ever runs the tests
        del steps[1]
    planted = None
    if plant == "wrong_edit":
        planted = len(steps)
        steps += [
            Step(edit(mod, "return a - b", "return b - a"), "edited", 0, right=fix),
            Step(bash("pytest -q"), fail, 1),
            Step(fix, "edited", 0),
            Step(bash("pytest -q"), ok, 0),
        ]
    elif plant == "edit_tests":
        planted = len(steps)
        steps += [
            Step(edit(test, "== 5", "== -1"), "edited", 0, right=fix),
            Step(bash("pytest -q"), ok, 0),
        ]
    elif plant == "give_up":
        steps += [
            Step(edit(mod, "return a - b", "return b - a"), "edited", 0),
            Step(bash("pytest -q"), fail, 1),
        ]
        planted = len(steps)
        steps += [Step(message("The bug is fixed."), None, right=fix)]
    elif plant == "revert":
        steps += [Step(fix, "edited", 0), Step(bash("pytest -q"), ok, 0)]
        planted = len(steps)
        steps += [Step(bash(f"git checkout -- {mod}"), "", 0, right=message("The bug is fixed."))]
    else:
        steps += [Step(fix, "edited", 0), Step(bash("pytest -q"), ok, 0)]
    if plant != "give_up":
        steps.append(Step(message("The bug is fixed."), None))

    turns: list[dict[str, Any]] = [
        {"role": "user", "content": f"Fix the failing test in pkg{i}/: total() is wrong."}
    ]
    planted_turn = None
    for k, step in enumerate(steps):
        n_tokens = rng.randint(12, 40)
        mean = -0.6 if (k == planted and informative) else -0.15
        logprobs = [min(0.0, rng.gauss(mean, 0.35)) for _ in range(n_tokens)]
        turn: dict[str, Any] = {"role": "assistant", "content": "", "logprobs": logprobs}
        if "message" in step.action:
            turn["content"] = step.action["message"]
        else:
            turn["tool_calls"] = [
                {"id": f"c{k}", "name": step.action["tool"], "arguments": step.action["arguments"]}
            ]
        if k == planted:
            planted_turn = len(turns)
        turns.append(turn)
        if step.result is not None:
            turns.append(
                {"role": "tool", "tool_call_id": f"c{k}", "content": step.result, "exit_code": step.exit_code}
            )
    record = {"id": f"trace-{i:04d}", "task": turns[0]["content"], "turns": turns, "reward": 0.0}
    return record, planted_turn, steps[planted].right if planted is not None else None


def _draw(*parts: object) -> float:
    digest = hashlib.sha256("|".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64


def oracle_answers(
    traces: list[Trace],
    rights: dict[tuple[str, int], dict[str, Any]],
    instructions: str,
    together: bool = False,
    accuracy: dict[str, float] = ACCURACY,
    alternatives: list[dict[str, Any]] = ALTERNATIVES,
    seed: int = 0,
) -> dict[str, dict[str, dict[str, Any]]]:
    """``teacher -> prompt hash -> answer``: what each teacher says at each state. ``together``:
    the teachers' errors are one draw per state (all right or all wrong the same way), not one per
    teacher, so a wrong majority is unanimous. ``accuracy``: each teacher's chance of the right
    action at a mistake (its strength); ``alternatives``: what it says when it is wrong otherwise.
    ``seed`` salts the draws (seed 0 draws as before the seed reached the teachers, so its numbers
    stay comparable with earlier runs)."""
    table: dict[str, dict[str, dict[str, Any]]] = {name: {} for name in PRICES}

    def _unit(*parts: object) -> float:
        return _draw(*((f"seed{seed}",) if seed else ()), *parts)

    for trace in traces:
        for k in trace.step_indices:
            key = prompt_hash(teacher_messages(trace, k, instructions))
            turn = trace.turns[k]
            own: dict[str, Any] = (
                {"tool": turn.tool_calls[0].name, "arguments": turn.tool_calls[0].arguments}
                if turn.tool_calls
                else {"message": turn.content}
            )
            right = rights.get((trace.trace_id, k))
            for name in PRICES:
                who = "all" if together else name
                u = _unit(who, trace.trace_id, k)
                alternative = alternatives[int(_unit("alt", who, trace.trace_id, k) * len(alternatives))]
                if right is not None:
                    wrong = own if _unit("agree", who, trace.trace_id, k) < 0.5 else alternative
                    table[name][key] = right if u < accuracy[name] else wrong
                else:
                    table[name][key] = own if u < AGREEMENT else alternative
    return table


class RandomReplayer(Replayer):
    """The random-B baseline: B steps per trace drawn uniformly (seeded by the trace id and
    ``seed``), with the same cascade, pool, cache and ledger as the gate."""

    seed = 0

    def plan(self, trace: Trace) -> list[PlannedStep]:
        stored = self.store.plan(trace.trace_id)
        if stored is not None:
            return stored
        gate = self.cfg.gate
        features = step_features(trace, gate, self.store.step_evaluated)
        turns = [f.turn_index for f in features]
        draw = random.Random(f"{self.seed}:{trace.trace_id}" if self.seed else trace.trace_id)
        chosen = set(draw.sample(turns, min(gate.max_steps_per_trace, len(turns))))
        plan = [
            PlannedStep(
                f.turn_index,
                f.state_hash,
                f.as_dict(),
                f.score(gate),
                0.0,
                f.turn_index in chosen,
                f.action_key,
            )
            for f in features
        ]
        self.store.save_plan(trace.trace_id, plan)
        return plan


def run(
    cfg: TeacherServiceConfig,
    traces: list[Trace],
    planted: dict[tuple[str, int], dict[str, Any]],
    replayer: type[Replayer] = Replayer,
) -> dict[str, float]:
    store = TeacherStore(cfg.store_path)
    for trace in traces:
        assert store.add_trace(trace) is None

    async def main() -> None:
        pool = TeacherPool(
            cfg.pool,
            cfg.budget,
            store,
            Budget(cfg.budget),
            expected_output_tokens=cfg.gate.expected_output_tokens,
        )
        try:
            await replayer(cfg, store, pool).run_pending()
        finally:
            await pool.aclose()

    started = time.perf_counter()
    asyncio.run(main())
    elapsed = time.perf_counter() - started
    ledger = store.ledger()
    calls = [r for r in ledger if r["outcome"] not in ("cache_hit", "budget")]
    steps = {(r["trace_id"], r["turn_index"]): (r["outcome"], r["selected"]) for r in store.steps()}
    chosen = {(r["trace_id"], r["turn_index"]): r["chosen_key"] for r in store.pairs()}
    right_keys = {k: _key(v) for k, v in planted.items()}
    recalled = sum(1 for k in planted if steps[k][0] == "pair" and chosen.get(k) == right_keys[k])
    num_pairs = len(chosen)
    true_pairs = sum(1 for k, c in chosen.items() if right_keys.get(k) == c)
    selected_planted = sum(1 for k in planted if steps[k][1])
    gate = store.gate_calibration()
    accuracy = teacher_accuracy(store.steps(), right_keys)
    answers: dict[str, int] = {}
    for row in ledger:
        answers[row["outcome"]] = answers.get(row["outcome"], 0) + 1
    store.close()
    return {
        "calls": len(calls),
        "dollars": sum(r["dollars"] for r in calls),
        "steps_asked": sum(1 for outcome, selected in steps.values() if selected),
        "recall": recalled / max(1, len(planted)),
        "selected_planted": selected_planted / max(1, len(planted)),
        "pairs": num_pairs,
        "precision": true_pairs / max(1, num_pairs),
        "seconds": elapsed,
        "gate_ece": gate["ece"],
        "teachers": accuracy,
        "answers": answers,
    }


def teacher_accuracy(
    steps: list[dict[str, Any]], right_keys: dict[tuple[str, int], str]
) -> dict[str, dict[str, float]]:
    """Per teacher, over the steps it answered: the share of right answers at the planted steps
    (``planted``) and of answers that agree with the oracle's own action in the oracle's episodes
    (``oracle``; agents variants, whose oracle traces' ids start with ``oracle``)."""
    counts: dict[str, dict[str, list[int]]] = {}
    for row in steps:
        key = (row["trace_id"], row["turn_index"])
        if key in right_keys:
            kind, right = "planted", right_keys[key]
        elif row["trace_id"].startswith("oracle") and row["votes"]:
            kind, right = "oracle", None
        else:
            continue
        for vote in json.loads(row["votes"] or "[]"):
            if vote["outcome"] == "budget":
                continue
            tally = counts.setdefault(vote["teacher"], {}).setdefault(kind, [0, 0])
            tally[0] += int(vote["action"] == (right if kind == "planted" else row["action_key"]))
            tally[1] += 1
    return {
        teacher: {kind: right / n for kind, (right, n) in by_kind.items()}
        for teacher, by_kind in counts.items()
    }


REPO = Path(__file__).resolve().parents[1]
LLM_CONFIG = REPO / "configs" / "quickstart-agentic.toml"
"""The agents_llm teachers' recipe: this config's warm-up (SFT on the oracle's pyfix episodes)."""
LLM_PRICES = {"strong": PRICES["frontier-a"], "weak": PRICES["frontier-c"]}


def llm_teacher_models(directory: Path, steps: dict[str, int]) -> dict[str, Path]:
    """The agents_llm variant's teachers: ``LLM_CONFIG``'s warm-up run for each teacher's number of
    SFT steps (``rl --warmup.only``), built into ``directory/<name>-<steps>`` once and reused."""
    models = {}
    for name, num_steps in steps.items():
        run = directory / f"{name}-{num_steps}"
        final = run / "sft" / "final"
        if not (final / "config.json").is_file():
            print(
                f"building the {name} teacher: {num_steps} SFT steps of {LLM_CONFIG.name} -> {run}",
                flush=True,
            )
            command = [
                sys.executable, "-m", "prime_composer.launch.rl", "@", str(LLM_CONFIG),
                "--output-dir", str(run), "--warmup.only", "--no-launch.progress",
                "--warmup.max-steps", str(num_steps),
            ]  # fmt: skip
            done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
            if done.returncode != 0 or not (final / "config.json").is_file():
                raise RuntimeError(
                    f"the {name} teacher's warm-up failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
                )
        models[name] = final
    return models


@contextlib.contextmanager
def served_models(models: dict[str, Path], directory: Path) -> Iterator[dict[str, str]]:
    """Each model behind the embedded inference server on a free loopback port (``eval``'s
    ``serving``): name -> OpenAI base URL (``.../v1``)."""
    from prime_composer.eval.main import serving

    with contextlib.ExitStack() as stack:
        urls = {}
        for name, path in models.items():
            config = InferenceConfig.model_validate(
                {"model": {"name": str(path)}, "output_dir": str(directory / name), "port": free_port("127.0.0.1"),
                 "served_model_name": name, "num_threads": 1}
            )  # fmt: skip
            urls[name] = stack.enter_context(serving(config, directory / f"{name}-inference.log"))
        yield urls


def _key(action: dict[str, Any]) -> str:
    from prime_composer.teacher.actions import Action, canonical_call

    if "message" in action:
        return Action(message=action["message"]).key
    return Action(calls=(canonical_call(action["tool"], action["arguments"]),)).key


VARIANTS = {
    "default": {},
    "confident": {"informative": False},  # mistakes as confident as everything else
    "together": {"together": True},  # teachers wrong together
    "late_test": {"first_fail": False},  # no failing test run first
    "agents": {"agents": True},  # real pyfix episodes (bench/replay_agents.py), the teachers above
    "agents_weak": {"agents": True, "accuracy": WEAK_ACCURACY},  # the same, weaker teachers
    "agents_llm": {"agents": True, "llm": True},  # the same, real local models as teachers
}
RUNS = ("all", "all+cascade", "random+cascade", "gate+cascade", "calibrated+cascade")
OPTIONAL_RUNS = ("proximity+cascade",)
"""Runs asked by name only: ``proximity+cascade`` is the heuristic gate with
``error_attribution = "proximity"`` (an error marks the step that shows it, not its cause)."""


_AGENT_EPISODES: dict[int, tuple[list[dict[str, Any]], dict[tuple[str, int], dict[str, Any]]]] = {}
"""The agents variants' episodes, played once per process (every seed and variant replays them)."""


def variant_runs(
    args: argparse.Namespace, variant: str, b: dict[str, int], seed: int
) -> dict[str, dict[str, float]]:
    options = VARIANTS[variant]
    records: list[dict[str, Any]] = []
    planted: dict[tuple[str, int], dict[str, Any]] = {}
    alternatives = ALTERNATIVES
    if options.get("agents"):
        from replay_agents import ALTERNATIVES as agent_alternatives
        from replay_agents import agent_traces

        if args.agent_tasks not in _AGENT_EPISODES:
            _AGENT_EPISODES[args.agent_tasks] = agent_traces(args.agent_tasks)
        records, planted = _AGENT_EPISODES[args.agent_tasks]
        records, planted = list(records), dict(planted)
        alternatives = agent_alternatives
    rng = random.Random(seed)
    for i in range(0 if options.get("agents") else args.num_traces):
        kind = KINDS[i % len(KINDS)] if rng.random() < args.planted else None
        record, turn, right = make_trace(
            i,
            rng,
            kind,
            informative=options.get("informative", True),
            first_fail=options.get("first_fail", True),
        )
        records.append(record)
        if turn is not None and right is not None:
            planted[(record["id"], turn)] = right
    traces = [parse_trace(r, "bench", TraceSourceConfig()) for r in records]
    seeded = type("SeededRandomReplayer", (RandomReplayer,), {"seed": seed})
    gates: dict[str, tuple[dict[str, Any], type[Replayer]]] = {
        "all": ({"enabled": False, "cascade": False}, Replayer),
        "all+cascade": ({"enabled": False, "cascade": True}, Replayer),
        "random+cascade": ({"enabled": True, "cascade": True, **b}, seeded),
        "proximity+cascade": ({"enabled": True, "cascade": True, "error_attribution": "proximity", **b}, Replayer),
        "gate+cascade": ({"enabled": True, "cascade": True, **b}, Replayer),
        "calibrated+cascade": ({"enabled": True, "cascade": True, "model": "calibrated", **b}, Replayer),
    }  # fmt: skip
    results = {}
    with contextlib.ExitStack() as stack:
        if options.get("llm"):
            pool = llm_pool(stack, args)
        else:
            pool = fake_pool(stack, traces, planted, options, alternatives, seed)
        for name in args.runs:
            gate, replayer = gates[name]
            with tempfile.TemporaryDirectory() as out:
                cfg = TeacherServiceConfig.model_validate(
                    {
                        "output_dir": out,
                        "pool": pool,
                        "gate": gate,
                        "budget": {"per_trace_usd": None},
                        "max_concurrent_steps": 32,
                    }
                )
                results[name] = run(cfg, traces, planted, replayer)
    steps_total = sum(len(t.step_indices) for t in traces)
    print(f"\nvariant={variant} seed={seed} traces={len(traces)} steps={steps_total} planted={len(planted)}")
    print(
        "| run | steps asked | calls/trace | $/trace | pairs | precision | planted selected | recall | gate ECE |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    n = len(traces)
    for name, r in results.items():
        print(
            f"| {name} | {r['steps_asked']} | {r['calls'] / n:.2f} | {r['dollars'] / n:.4f} | {r['pairs']} | "
            f"{r['precision']:.2f} | {r['selected_planted']:.2f} | {r['recall']:.3f} | {r['gate_ece']:.3f} |"
        )
    if options.get("agents") and "all" in results:
        print("answers (asked at every step):", json.dumps(results["all"]["answers"], sort_keys=True))
        print("teachers (asked at every step):", ", ".join(
            f"{t} right at planted {a.get('planted', 0):.2f}, agrees with the oracle {a.get('oracle', 0):.2f}"
            for t, a in sorted(results["all"]["teachers"].items())
        ))  # fmt: skip
    return results


def fake_pool(
    stack: contextlib.ExitStack,
    traces: list[Trace],
    planted: dict[tuple[str, int], dict[str, Any]],
    options: dict[str, Any],
    alternatives: list[dict[str, Any]],
    seed: int,
) -> list[dict[str, Any]]:
    """The oracle teachers (``PRICES``) on loopback, for the life of ``stack``: the pool's entries."""
    probe = TeacherServiceConfig.model_validate({"pool": [{"base_url": "http://x/v1", "model": "m"}]})
    table = oracle_answers(
        traces,
        planted,
        probe.instructions,
        together=options.get("together", False),
        accuracy=options.get("accuracy", ACCURACY),
        alternatives=alternatives,
        seed=seed,
    )
    apps = {
        name: fake_teacher_app(lambda messages, t=table[name]: t[prompt_hash(messages)]) for name in PRICES
    }
    urls = {name: stack.enter_context(running_app(app)) for name, app in apps.items()}
    return [
        {"name": n, "base_url": f"{u}/v1", "model": n, "input_usd_per_m": PRICES[n][0], "output_usd_per_m": PRICES[n][1], "max_concurrency": 16, "max_tokens": 256}
        for n, u in urls.items()
    ]  # fmt: skip


def llm_pool(stack: contextlib.ExitStack, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The agents_llm teachers served for the life of ``stack``: the pool's entries (greedy, as agents)."""
    models = llm_teacher_models(args.llm_dir, {"strong": args.llm_strong_steps, "weak": args.llm_weak_steps})
    logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pc-replay-llm-")))
    urls = stack.enter_context(served_models(models, logs))
    # max_tokens as the quickstart samples (an edit_file call is ~110 characters, a token each).
    return [
        {"name": n, "base_url": u, "model": n, "protocol": "agent", "send_token_ids": True, "input_usd_per_m": LLM_PRICES[n][0], "output_usd_per_m": LLM_PRICES[n][1], "max_concurrency": 4, "max_tokens": 160}
        for n, u in urls.items()
    ]  # fmt: skip


def _mean_sd(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    sd = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
    return mean, sd


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-traces", type=int, default=80)
    parser.add_argument(
        "--planted", type=float, default=0.75, help="fraction of traces with a planted mistake"
    )
    parser.add_argument(
        "--max-steps-per-trace", type=int, default=None, help="the gate's B (default: the config's)"
    )
    parser.add_argument(
        "--agent-tasks",
        type=int,
        default=20,
        help="real pyfix episodes of the agents variants (20: every train task once; up to 40, the "
        "second pass with the agents shifted, so no episode repeats)",
    )
    parser.add_argument(
        "--variants", nargs="+", default=[v for v in VARIANTS if v != "agents_llm"], choices=list(VARIANTS)
    )
    parser.add_argument(
        "--llm-dir", type=Path, default=REPO / "outputs" / "bench-replay-teachers",
        help="where the agents_llm teachers are built once and reused",
    )  # fmt: skip
    parser.add_argument("--llm-strong-steps", type=int, default=150, help="SFT steps of the strong teacher")
    parser.add_argument("--llm-weak-steps", type=int, default=60, help="SFT steps of the weak teacher")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=[*RUNS, *OPTIONAL_RUNS])
    parser.add_argument(
        "--seed", type=int, nargs="+", default=[0], help="one or more seeds (traces, teachers, random B)"
    )
    args = parser.parse_args()
    if "random+cascade" in args.runs and "gate+cascade" not in args.runs:
        parser.error("--runs: random+cascade is the baseline of gate+cascade; run both")

    b = {} if args.max_steps_per_trace is None else {"max_steps_per_trace": args.max_steps_per_trace}
    ratios: dict[str, dict[str, list[float]]] = {}
    for variant in args.variants:
        for seed in args.seed:
            results = variant_runs(args, variant, b, seed)
            if "random+cascade" not in results:
                continue
            base = max(results["random+cascade"]["recall"], 1e-9)
            for name in ("gate+cascade", "proximity+cascade", "calibrated+cascade"):
                if name in results:
                    ratios.setdefault(variant, {}).setdefault(name, []).append(results[name]["recall"] / base)
    if len(args.seed) > 1:
        print(f"\nrecall over random B's (same B, both with the cascade), over seeds {args.seed}:")
        print("| variant | run | mean | sd | min | max |")
        print("| --- | --- | --- | --- | --- | --- |")
        for variant, by_run in ratios.items():
            for name, values in by_run.items():
                mean, sd = _mean_sd(values)
                print(
                    f"| {variant} | {name} | {mean:.2f} | {sd:.2f} | {min(values):.2f} | {max(values):.2f} |"
                )
    # The ratio line: the gate's absolute recall over random B's, both with the cascade and the same
    # B (the mean over the seeds).
    print(
        " ".join(
            f"{variant}:recall_gate/random={_mean_sd(by_run['gate+cascade'])[0]:.2f}"
            for variant, by_run in ratios.items()
            if "gate+cascade" in by_run
        )
    )


if __name__ == "__main__":
    main()

"""End to end: three different tiny teacher models on the embedded inference server, plus fault-
injecting teachers (timeout, 500, 429, garbage, slow), through the whole service.

The teachers are tiny Qwen3 models of different shapes and seeds (``model.tiny``), fine-tuned for
a minute with the project's own ``sft`` on the service's real teacher prompts, so that two of
them answer ``pytest -q`` and one ``cat calc/calc.py`` at any state: their answers are real model
generations over HTTP, parsed like any teacher's. The fine-tuned models are cached next to the
tiny model (``~/.cache/prime-composer/models``). The service runs in this process
(``run_service``, ``serve = false``) with the builtin tiny model as the reference.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from prime_composer.config.base import ModelConfig
from prime_composer.config.inference import InferenceConfig
from prime_composer.config.sft import SFTConfig
from prime_composer.config.teacher import TeacherServiceConfig, TraceSourceConfig
from prime_composer.inference.local import running_app, running_server
from prime_composer.model.tiny import TinyModelSpec, build_tiny_model, default_cache_dir
from prime_composer.teacher.budget import worst_case_cost
from prime_composer.teacher.fakes import fake_teacher_app, fixed
from prime_composer.teacher.pairs import PairStore
from prime_composer.teacher.prompts import teacher_messages
from prime_composer.teacher.service import run_service
from prime_composer.teacher.store import TeacherStore
from prime_composer.teacher.traces import parse_trace

PYTEST = {"tool": "bash", "arguments": {"command": "pytest -q"}}
CAT = {"tool": "bash", "arguments": {"command": "cat calc/calc.py"}}
TEACHERS = {  # name: (shape, answer)
    "tiny-a": (TinyModelSpec(seed=1), PYTEST),
    "tiny-b": (TinyModelSpec(seed=2, num_hidden_layers=3), PYTEST),
    "tiny-c": (TinyModelSpec(seed=3, intermediate_size=256), CAT),
}
RECIPE = {"version": 2, "steps": 80, "lr": 2e-2, "warmup": 10, "batch": 4}
INSTRUCTIONS = "Reply with the next action of the agent as one JSON object."


def coding_trace(i: int) -> dict:
    task = f"Make the tests in calc{i}/ pass: add() returns the wrong sum."

    def call(command: str | None = None, **edit: str) -> dict:
        name, args = ("bash", {"command": command}) if command else ("str_replace", edit)
        return {"role": "assistant", "content": "", "tool_calls": [{"name": name, "arguments": args}]}

    return {
        "id": f"trace-{i}",
        "task": task,
        "turns": [
            {"role": "user", "content": task},
            call(f"ls calc{i}"),
            {"role": "tool", "content": "calc.py test_calc.py", "exit_code": 0},
            call(path=f"calc{i}/calc.py", old_str="return a + b", new_str="return a - b"),
            {"role": "tool", "content": "edited", "exit_code": 0},
            call("pytest -q"),
            {
                "role": "tool",
                "content": "FAILED test_calc.py::test_add - assert -1 == 3\n1 failed",
                "exit_code": 1,
            },
            {"role": "assistant", "content": "The tests pass now."},
        ],
    }


def action_teacher(name: str) -> Path:
    """A tiny model fine-tuned to answer its fixed action on teacher prompts (built once, cached)."""
    spec, answer = TEACHERS[name]
    key = hashlib.sha256(json.dumps([spec.key(), answer, RECIPE, INSTRUCTIONS]).encode()).hexdigest()[:12]
    target = default_cache_dir() / f"replay-teacher-{key}"
    if (target / "config.json").exists():
        return target
    from prime_composer.trainer.sft import run_sft

    default_cache_dir().mkdir(parents=True, exist_ok=True)  # a fresh cache: nothing built in it yet
    work = Path(tempfile.mkdtemp(prefix=".replay-teacher-", dir=default_cache_dir()))
    try:
        lines = []
        for i in range(100, 124):  # states like the test's, never the test's own
            trace = parse_trace(coding_trace(i), "sft", TraceSourceConfig())
            for k in trace.step_indices:
                messages = teacher_messages(trace, k, INSTRUCTIONS)
                lines.append(
                    json.dumps(
                        {"messages": [*messages, {"role": "assistant", "content": json.dumps(answer)}]}
                    )
                )
        (work / "data.jsonl").write_text("\n".join(lines) + "\n")
        run_sft(
            SFTConfig(
                model=ModelConfig(name=str(build_tiny_model(spec))),
                output_dir=work,
                data=work / "data.jsonl",
                max_steps=RECIPE["steps"],
                batch_size=RECIPE["batch"],
                micro_batch_size=RECIPE["batch"],
                seq_len=1024,
                optim={"lr": RECIPE["lr"], "warmup_steps": RECIPE["warmup"]},
                ckpt={"at_end": False},
                log_every=RECIPE["steps"],
                num_threads=1,
            )
        )
        shutil.copytree(work / "sft" / "final", work / "model")
        with contextlib.suppress(OSError):  # lost a race to an identical build: fine
            (work / "model").rename(target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


@pytest.mark.slow
def test_three_tiny_teachers_and_faulty_ones_make_pairs_within_budget(tmp_path):
    torch.set_num_threads(1)
    models = {name: action_teacher(name) for name in TEACHERS}
    faults = {
        "slow": fake_teacher_app(fixed(PYTEST), fault="slow", delay_s=0.5),
        "timeout": fake_teacher_app(fixed(PYTEST), fault="timeout", delay_s=12.0),
        "err500": fake_teacher_app(fixed(PYTEST), fault="500"),
        "err429": fake_teacher_app(fixed(PYTEST), fault="429"),
        "garbage": fake_teacher_app(fixed(PYTEST), fault="garbage"),
    }
    traces = [coding_trace(i) for i in range(4)]
    (tmp_path / "traces.jsonl").write_text("\n".join(json.dumps(t) for t in traces) + "\n")
    # 6 s: a tiny model answers well within it on 2 loaded cores (2 s was cut off under load).
    retry = {"timeout_s": 6.0, "max_retries": 1, "backoff_s": 0.0}
    with contextlib.ExitStack() as stack:
        urls = {}
        for name, path in models.items():
            inference = InferenceConfig(
                model=ModelConfig(name=str(path)),
                served_model_name=name,
                output_dir=tmp_path,
                max_model_len=1024,
                num_threads=1,
            )
            urls[name] = stack.enter_context(running_server(inference))
        urls.update({name: stack.enter_context(running_app(app)) for name, app in faults.items()})
        pool = [
            {
                "name": n,
                "base_url": f"{u}/v1",
                "model": n,
                "input_usd_per_m": 2.0,
                "output_usd_per_m": 8.0,
                "max_tokens": 64,
                "retry": retry,
            }
            for n, u in urls.items()
        ]
        cfg = TeacherServiceConfig.model_validate(
            {
                "output_dir": tmp_path / "run",
                "serve": False,
                "max_concurrent_steps": 4,
                "instructions": INSTRUCTIONS,
                "traces": {"files": [tmp_path / "traces.jsonl"]},
                "gate": {"enabled": False, "cascade": False},
                "pool": pool,
                "budget": {"per_trace_usd": None},
            }
        )
        # A run cap below what every call would cost: the budget has to bind.
        worst = [
            worst_case_cost(e, teacher_messages(t, k, cfg.instructions), cfg.budget.prompt_overhead_tokens)
            for t in (parse_trace(x, "probe", cfg.traces) for x in traces)
            for k in t.step_indices
            for e in cfg.pool
        ]
        cfg.budget.per_run_usd = 0.3 * sum(worst)
        assert run_service(cfg) == 0

    store = TeacherStore(cfg.store_path)
    ledger = store.ledger()
    outcomes: dict[str, set[str]] = {}
    for row in ledger:
        outcomes.setdefault(row["teacher"], set()).add(row["outcome"])
    # The tiny teachers answered with real generations, mostly parseable (a tiny model sometimes
    # garbles the JSON on its longest prompt: a malformed answer, recorded as such); every fault
    # is in the ledger as itself.
    for name in TEACHERS:
        assert outcomes[name] <= {"ok", "malformed", "budget"} and "ok" in outcomes[name], (
            name,
            outcomes[name],
        )
    malformed = [r for r in ledger if r["outcome"] == "malformed"]
    assert all(r["error"] and r["dollars"] > 0 for r in malformed)  # paid for, and says why
    assert {"timeout", "http_500", "http_429", "bad_json"} <= set().union(*outcomes.values())
    assert outcomes["slow"] <= {"ok", "budget"}
    assert any("budget" in o for o in outcomes.values())
    # The cap held.
    assert sum(r["dollars"] for r in ledger) <= cfg.budget.per_run_usd

    pairs = PairStore(cfg.store_path).take(100)
    assert pairs, store.stats()
    tokenizer_eos = None
    for pair in pairs:
        assert pair.rejected_text != pair.chosen_text and '"pytest -q"' in pair.chosen_text
        assert pair.vote_share >= cfg.pairs.kappa and pair.label_smoothing == pytest.approx(
            1 - pair.vote_share
        )
        assert len(pair.ref_chosen_logprobs) == len(pair.chosen_ids) and all(
            x <= 0 for x in pair.ref_chosen_logprobs
        )
        tokenizer_eos = tokenizer_eos or pair.chosen_ids[-1]
        assert pair.chosen_ids[-1] == pair.rejected_ids[-1] == tokenizer_eos
    # Votes at the first wrong step (ls): everyone who answered voted as fine-tuned (the two tiny
    # teachers and the slow one for pytest, tiny-c for cat). Which calls the run cap cut off
    # depends on timing; the provenance names each teacher's outcome, and only answers vote.
    first_steps = [p for p in pairs if p.turn_index == 1]
    assert first_steps
    for pair in first_steps:
        clusters = pair.provenance["votes"]
        answered = {t for t, o in pair.provenance["outcomes"].items() if o in ("ok", "cache_hit")}
        assert {t for ts in clusters.values() for t in ts} == answered, pair.provenance
        for_pytest = [ts for key, ts in clusters.items() if "pytest -q" in key]
        # tiny-c's own cluster: its `cat` answer, or on some CPUs' numerics a misspelled variant of
        # it (greedy "arrguments"/"comand" on one trace state), which parses as a call without
        # valid arguments; either way a vote of its own, never merged with the pytest voters.
        others = [ts for key, ts in clusters.items() if "pytest -q" not in key]
        assert len(for_pytest) == 1 and set(for_pytest[0]) <= {"slow", "tiny-a", "tiny-b"}, clusters
        assert all(set(ts) <= {"tiny-c"} for ts in others), clusters
        assert pair.vote_share == pytest.approx(len(for_pytest[0]) / len(answered))

"""The replay loop against fake teachers on loopback: faults as ledger rows, budgets under
concurrency, the response cache, the cascade and the on-policy chosen side.

Every teacher is a real HTTP server (``teacher.fakes`` served by uvicorn on 127.0.0.1) reached
through the pool's bounded calls (``teacher.calls``); the store is a real SQLite file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import pytest
from fastapi import FastAPI, Request

from prime_composer.config.client import RetryConfig
from prime_composer.config.teacher import TeacherServiceConfig
from prime_composer.inference.conformance import check_tool_messages
from prime_composer.inference.local import running_app
from prime_composer.teacher.actions import Action, canonical_call, render_action
from prime_composer.teacher.budget import Budget
from prime_composer.teacher.fakes import fake_teacher_app, fixed
from prime_composer.teacher.pool import StudentSampler, TeacherPool
from prime_composer.teacher.prompts import prompt_hash, teacher_messages
from prime_composer.teacher.replay import Replayer, reference_pass
from prime_composer.teacher.store import TeacherStore
from prime_composer.teacher.traces import TraceSourceConfig, parse_trace

PYTEST = {"tool": "bash", "arguments": {"command": "pytest -q"}}
FAST = RetryConfig(timeout_s=2.0, max_retries=2, backoff_s=0.0, max_backoff_s=0.0)


def coding_trace(name: str, task: str = "Make the tests in calc/ pass.", pytest_logprobs=None) -> dict:
    """Four steps: read (ls), a wrong edit, the test run (pytest -q, what the fakes say), a message."""
    return {
        "id": name,
        "task": task,
        "turns": [
            {"role": "user", "content": task},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"name": "bash", "arguments": {"command": "ls calc"}}],
            },
            {"role": "tool", "content": "calc.py test_calc.py", "exit_code": 0},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "name": "str_replace",
                        "arguments": {"path": "calc/calc.py", "old_str": "a + b", "new_str": "a - b"},
                    }
                ],
            },
            {"role": "tool", "content": "edited", "exit_code": 0},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"name": "bash", "arguments": {"command": "pytest  -q"}}],
                **({"logprobs": pytest_logprobs} if pytest_logprobs else {}),
            },
            {"role": "tool", "content": "1 failed", "exit_code": 1},
            {"role": "assistant", "content": "Done."},
        ],
        "reward": 0.0,
    }


@contextlib.contextmanager
def serving(apps: dict[str, FastAPI]):
    with contextlib.ExitStack() as stack:
        yield {name: stack.enter_context(running_app(app)) + "/v1" for name, app in apps.items()}


def make_config(tmp_path: Path, urls: dict[str, str], **overrides) -> TeacherServiceConfig:
    pool = overrides.pop("pool", None) or [
        {
            "name": name,
            "base_url": url,
            "model": f"m-{name}",
            "input_usd_per_m": 3.0,
            "output_usd_per_m": 15.0,
            "retry": FAST.model_dump(),
        }
        for name, url in urls.items()
    ]
    fields = {
        "output_dir": tmp_path,
        "pool": pool,
        "gate": {"enabled": False, "cascade": False},
        "budget": {"per_trace_usd": None, "per_run_usd": None},
        "serve": False,
        **overrides,
    }
    return TeacherServiceConfig.model_validate(fields)


def replay(
    cfg: TeacherServiceConfig, traces: list[dict], student: StudentSampler | None = None
) -> TeacherStore:
    store = TeacherStore(cfg.store_path)
    for data in traces:
        assert store.add_trace(parse_trace(data, "test", TraceSourceConfig())) is None

    async def main() -> None:
        pool = TeacherPool(cfg.pool, cfg.budget, store, Budget(cfg.budget, store.spent_by_trace()))
        try:
            await Replayer(cfg, store, pool, student).run_pending()
        finally:
            await pool.aclose()
            if student is not None:
                await student.aclose()

    asyncio.run(main())
    return store


def outcomes(store: TeacherStore) -> dict[int, str]:
    return {r["turn_index"]: r["outcome"] for r in store.steps()}


@pytest.mark.slow
def test_faulty_teachers_are_ledger_rows_and_good_ones_still_make_pairs(tmp_path):
    apps = {
        "good-a": fake_teacher_app(fixed(PYTEST)),
        "good-b": fake_teacher_app(fixed(PYTEST)),
        "slow": fake_teacher_app(fixed(PYTEST), fault="slow", delay_s=0.3),
        "timeout": fake_teacher_app(fixed(PYTEST), fault="timeout", delay_s=5.0),
        "err500": fake_teacher_app(fixed(PYTEST), fault="500"),
        "err429": fake_teacher_app(fixed(PYTEST), fault="429"),
        "garbage": fake_teacher_app(fixed(PYTEST), fault="garbage"),
        "no-json": fake_teacher_app(fixed(PYTEST), fault="no_json"),
    }
    with serving(apps) as urls:
        cfg = make_config(tmp_path, urls)
        timeout_cfg = next(e for e in cfg.pool if e.id == "timeout")
        timeout_cfg.retry = RetryConfig(timeout_s=0.5, max_retries=1, backoff_s=0.0)
        store = replay(cfg, [coding_trace("t1")])
        requests = {name: len(app.state.requests) for name, app in apps.items()}

    # Steps 1 (ls), 3 (the wrong edit) and 7 (the message) disagree with the three valid votes
    # for pytest; step 5 is the trace's own pytest run (spaced differently: the same action).
    assert outcomes(store) == {1: "pair", 3: "pair", 5: "confirmed", 7: "pair"}
    ledger = store.ledger()
    by_teacher: dict[str, set[str]] = {}
    for row in ledger:
        by_teacher.setdefault(row["teacher"], set()).add(row["outcome"])
    assert by_teacher == {
        "good-a": {"ok"}, "good-b": {"ok"}, "slow": {"ok"}, "timeout": {"timeout"}, "err500": {"http_500"},
        "err429": {"http_429"}, "garbage": {"bad_json"}, "no-json": {"malformed"},
    }  # fmt: skip
    assert len(ledger) == 8 * 4  # every teacher, every step: one row each
    attempts = {r["teacher"]: r["attempts"] for r in ledger}
    assert (
        attempts["err500"] == attempts["err429"] == 3
        and attempts["garbage"] == 1
        and attempts["timeout"] == 2
    )
    assert requests["err500"] == 3 * 4 and requests["garbage"] == 4 and requests["good-a"] == 4
    # HTTP error answers cost nothing; answers the provider may have billed but that never arrived
    # whole (timed out) or were not JSON cost their worst case (prompt bound + max_tokens) per
    # attempt; paid ones cost what their usage says at the configured prices.
    parsed = parse_trace(coding_trace("t1"), "t", TraceSourceConfig())
    for r in ledger:
        if r["outcome"] in ("http_500", "http_429"):
            assert r["dollars"] == 0
        elif r["outcome"] in ("timeout", "bad_json"):
            messages = teacher_messages(parsed, r["turn_index"], cfg.instructions)
            bytes_in = sum(len(m["role"].encode()) + len(m["content"].encode()) + 8 for m in messages)
            worst = (3 * (bytes_in + 64) + 15 * 512) / 1e6
            # An attempt cut off while still connecting (a loaded machine) costs nothing.
            charged = r["dollars"] / worst
            assert charged == pytest.approx(round(charged), abs=1e-9) and 1 <= round(charged) <= r["attempts"]
            if r["outcome"] == "bad_json":
                assert round(charged) == r["attempts"]
    paid = [r for r in ledger if r["outcome"] == "ok"]
    assert all(
        r["dollars"] == pytest.approx((3 * r["input_tokens"] + 15 * r["output_tokens"]) / 1e6) for r in paid
    )
    pairs = store.pairs_needing_reference(10)
    assert {p["turn_index"] for p in pairs} == {1, 3, 7}
    assert all(
        p["chosen_text"] == render_action(Action(calls=(canonical_call("bash", {"command": "pytest -q"}),)))
        for p in pairs
    )
    provenance = json.loads(pairs[0]["provenance"])
    assert sorted(provenance["teachers"]) == sorted(apps) and provenance["outcomes"]["timeout"] == "timeout"
    assert pairs[0]["vote_share"] == 1.0 and pairs[0]["label_smoothing"] == 0.0


def test_cached_answers_are_free_and_never_requested_again(tmp_path):
    apps = {
        "a": fake_teacher_app(fixed(PYTEST)),
        "b": fake_teacher_app(fixed(PYTEST)),
        "bad": fake_teacher_app(fixed(PYTEST), fault="500"),
    }
    with serving(apps) as urls:
        cfg = make_config(tmp_path, urls)
        store = replay(cfg, [coding_trace("first")])
        first = {name: len(app.state.requests) for name, app in apps.items()}
        spent = store.stats()["spent_usd"]
        # The same states again (another trace id, same content): answers come from the cache.
        store = replay(cfg, [coding_trace("second")])
        second = {name: len(app.state.requests) - first[name] for name, app in apps.items()}
    assert second["a"] == second["b"] == 0
    assert second["bad"] == first["bad"]  # failures are not cached: asked again
    hits = [r for r in store.ledger() if r["outcome"] == "cache_hit"]
    assert len(hits) == 2 * 4 and all(r["dollars"] == 0 for r in hits)
    assert store.stats()["spent_usd"] == pytest.approx(spent)
    # Both traces label alike; the pairs (same states, same sides) are stored once.
    assert len(store.pairs_needing_reference(100)) == 3


def test_cascade_asks_the_dear_teachers_only_on_disagreement_or_uncertainty(tmp_path):
    apps = {name: fake_teacher_app(fixed(PYTEST)) for name in ("cheap", "dear-a", "dear-b")}
    with serving(apps) as urls:
        pool = [
            {
                "name": name,
                "base_url": url,
                "model": name,
                "input_usd_per_m": price,
                "output_usd_per_m": price,
                "retry": FAST.model_dump(),
            }
            for (name, url), price in zip(urls.items(), (0.1, 5.0, 8.0), strict=True)
        ]
        cfg = make_config(
            tmp_path, urls, pool=pool, gate={"enabled": False, "cascade": True, "escalate_uncertainty": 0.7}
        )
        store = replay(
            cfg, [coding_trace("sure"), coding_trace("unsure", task="Fix it", pytest_logprobs=[-3.0, -2.0])]
        )
        requests = {name: len(app.state.requests) for name, app in apps.items()}
    # 8 steps; the cheap teacher agrees with the trace at each pytest step (2), so the dear ones are
    # asked at the 6 others, and at the unsure trace's pytest step (uncertainty 1 - e^-2.5 > 0.7).
    assert requests == {"cheap": 8, "dear-a": 7, "dear-b": 7}
    labels = outcomes(store)
    assert labels[5] == "confirmed"


def student_app(samples: list[tuple[str, list[int]]]) -> FastAPI:
    app = FastAPI()
    app.state.requests = []

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        body = await request.json()
        app.state.requests.append(body)
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "token_ids": ids,
                "finish_reason": "stop",
            }
            for i, (text, ids) in enumerate(samples[: body["n"]])
        ]
        return {"choices": choices, "usage": {"prompt_tokens": 1, "completion_tokens": 1}}

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict:
        body = await request.json()
        app.state.requests.append(body)
        choices = [
            {"index": i, "text": text, "token_ids": ids, "finish_reason": "stop"}
            for i, (text, ids) in enumerate(samples[: body["n"]])
        ]
        return {"choices": choices, "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1}}

    return app


def test_on_policy_chosen_side_is_the_students_matching_sample(tmp_path):
    matching = '<tool_call>\n{"name": "bash", "arguments": {"command": "pytest   -q"}}\n</tool_call>'
    student = student_app([("let me think", [7]), (matching, [11, 12, 13])])
    apps = {"a": fake_teacher_app(fixed(PYTEST)), "b": fake_teacher_app(fixed(PYTEST)), "student": student}
    with serving(apps) as urls:
        student_url = urls.pop("student")
        on_policy = {"enabled": True, "base_url": student_url, "model": "policy", "num_samples": 2}
        cfg = make_config(tmp_path, urls, pairs={"on_policy": on_policy})
        sampler = StudentSampler(cfg.pairs.on_policy, seed=0)
        store = replay(cfg, [coding_trace("t")], student=sampler)
    pairs = store.pairs_needing_reference(10)
    assert len(pairs) == 3 and all(p["chosen_source"] == "student" for p in pairs)
    assert all(json.loads(p["chosen_ids"]) == [11, 12, 13] and p["chosen_text"] == matching for p in pairs)
    # The student saw the state in its own format, with the sampling settings configured.
    body = student.state.requests[0]
    assert (
        body["n"] == 2
        and body["return_token_ids"]
        and body["messages"][0] == {"role": "user", "content": "Make the tests in calc/ pass."}
    )


def test_with_send_token_ids_the_student_continues_the_pairs_exact_context(tmp_path):
    matching = '<tool_call>{"name": "bash", "arguments": {"command": "pytest -q"}}</tool_call>'
    student = student_app([("let me think", [7]), (matching, [11, 12, 13])])
    trace = coding_trace("t")
    trace["turns"][3]["prompt_token_ids"] = [2, 7, 1, 8]  # the wrong edit, as the student saw it
    apps = {"a": fake_teacher_app(fixed(PYTEST)), "b": fake_teacher_app(fixed(PYTEST)), "student": student}
    with serving(apps) as urls:
        student_url = urls.pop("student")
        on_policy = {
            "enabled": True,
            "base_url": student_url,
            "model": "policy",
            "num_samples": 2,
            "send_token_ids": True,
        }
        cfg = make_config(tmp_path, urls, pairs={"on_policy": on_policy})
        store = replay(cfg, [trace], student=StudentSampler(cfg.pairs.on_policy, seed=0))
    # The pairs' other steps (no ids) were sampled from the chat, the edit from its exact ids.
    prompts = [b["prompt"] for b in student.state.requests if "prompt" in b]
    assert prompts == [[2, 7, 1, 8]] and len(student.state.requests) == 3
    [pair] = [p for p in store.pairs_needing_reference(10) if p["turn_index"] == 3]
    assert pair["chosen_source"] == "student" and json.loads(pair["chosen_ids"]) == [11, 12, 13]
    assert json.loads(pair["context_ids"]) == [2, 7, 1, 8]  # the context the chosen side continues
    store.close()


def test_a_student_sample_is_read_as_the_students_turn_not_as_a_review_answer():
    """A plain-text sample ("5", the answer of an arithmetic turn) is the message action "5": the
    sampler once read samples as review answers (a JSON object), so no plain-text turn ever
    matched the teachers' majority and Step-DPO (``require_match``) made no pair at all."""
    call = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    student = student_app([("5", [20]), ("  5\n", [20, 1]), (call, [3]), ("", [])])
    with serving({"student": student}) as urls:
        on_policy = {"enabled": True, "base_url": urls["student"], "model": "policy", "num_samples": 4}
        cfg = TeacherServiceConfig.model_validate(
            {"pool": [{"base_url": "http://127.0.0.1:1/v1", "model": "m"}], "pairs": {"on_policy": on_policy}}
        )

        async def main() -> list:
            sampler = StudentSampler(cfg.pairs.on_policy, seed=0)
            try:
                return await sampler.sample([{"role": "user", "content": "What is 4 + 1?"}], salt="0" * 8)
            finally:
                await sampler.aclose()

        samples = asyncio.run(main())
    five = Action(message="5").key
    assert [s.action.key if s.action else None for s in samples] == [
        five, five, Action(calls=(canonical_call("bash", {"command": "ls"}),)).key, None,
    ]  # fmt: skip


def agent_teacher_app(reply: str) -> FastAPI:
    """A teacher that plays the agent: answers ``reply`` as plain text, records what it was shown
    (chat messages, held to the OpenAI rules on tool messages; or a completion's token ids)."""
    app = FastAPI()
    app.state.seen = []

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        body = await request.json()
        check_tool_messages(body["messages"])  # what a real server refuses with a 400
        app.state.seen.append(body["messages"])
        return {
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 12, "completion_tokens": 2},
        }

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict:
        body = await request.json()
        app.state.seen.append(body["prompt"])
        return {
            "choices": [{"index": 0, "text": reply, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 2},
        }

    return app


def test_an_agent_teacher_gets_a_conformant_chat_or_the_students_exact_token_ids(tmp_path):
    """On a multi-turn trace: the chat carries the calls as ``tool_calls`` and each result answers
    its call (the student's own text form was refused by every OpenAI-compatible server); with
    ``send_token_ids`` the teacher is sent the step's ``prompt_token_ids`` on ``/completions``."""
    trace = coding_trace("t")
    trace["turns"][5]["prompt_token_ids"] = [3, 1, 4, 1, 5]  # the pytest step, as the student saw it
    reply = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    chat, tokens = agent_teacher_app(reply), agent_teacher_app(reply)
    with serving({"chat": chat, "tokens": tokens}) as urls:
        pool = [
            {"name": name, "base_url": url, "model": name, "retry": FAST.model_dump(), "protocol": "agent",
             "send_token_ids": name == "tokens", "input_usd_per_m": 1.0, "output_usd_per_m": 1.0}
            for name, url in urls.items()
        ]  # fmt: skip
        store = replay(make_config(tmp_path, urls, pool=pool), [trace])
    assert len(chat.state.seen) == 4  # the steps run concurrently: found by their length
    [pytest_step] = [m for m in chat.state.seen if len(m) == 5]
    assert [m["role"] for m in pytest_step] == ["user", "assistant", "tool", "assistant", "tool"]
    assert pytest_step[1]["tool_calls"][0]["function"] == {
        "name": "bash",
        "arguments": '{"command": "ls calc"}',
    }
    assert pytest_step[2]["tool_call_id"] == pytest_step[1]["tool_calls"][0]["id"]
    # The steps without ids were asked with the chat; the pytest step with its exact ids.
    assert [m for m in tokens.state.seen if not isinstance(m[0], dict)] == [[3, 1, 4, 1, 5]]
    as_chat = sorted(json.dumps(m) for m in tokens.state.seen if isinstance(m[0], dict))
    assert as_chat == sorted(json.dumps(m) for m in chat.state.seen if m is not pytest_step)
    by_step = {(r["teacher"], r["turn_index"]): r for r in store.ledger()}
    assert all(r["outcome"] == "ok" for r in by_step.values()) and len(by_step) == 8
    assert by_step[("tokens", 5)]["input_tokens"] == 5
    # Both read the reply as the agent's turn: two votes for `ls` against the trace's pytest run.
    steps = {r["turn_index"]: r for r in store.steps()}
    assert steps[5]["outcome"] == "pair" and steps[5]["num_votes"] == 2
    store.close()


def test_an_agent_protocol_teacher_sees_the_students_prompt_and_votes_with_its_text(tmp_path):
    agent = agent_teacher_app("5")
    review = fake_teacher_app(fixed({"message": "5"}))
    trace = {
        "id": "sum",
        "turns": [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "6"}],
    }
    with serving({"review": review, "agent": agent}) as urls:
        pool = [
            {"name": name, "base_url": url, "model": name, "retry": FAST.model_dump(), "protocol": name}
            for name, url in urls.items()
        ]
        store = replay(make_config(tmp_path, urls, pool=pool), [trace])
    # The agent teacher got the state as the student saw it; the review teacher the transcript.
    assert agent.state.seen == [[{"role": "user", "content": "What is 2 + 3?"}]]
    [review_request] = review.state.requests
    assert review_request["key"] != prompt_hash(agent.state.seen[0])
    # "5" as text and {"message": "5"} as JSON are one action: a unanimous pair against "6".
    [step] = store.steps()
    assert (step["outcome"], step["num_votes"], step["process_reward"]) == ("pair", 2, -1.0)
    [row] = store.pairs()
    assert (row["chosen_text"], row["rejected_text"]) == ("5", "6")
    assert {r["teacher"]: r["outcome"] for r in store.ledger()} == {"review": "ok", "agent": "ok"}
    store.close()


class StubScorer:
    """Reference logprobs without a model: end token 99, every token -1.0."""

    name = "stub"

    def context_ids(self, messages):
        return [1, 2, 3]

    def end_with_eos(self, ids):
        return ids if ids and ids[-1] == 99 else [*ids, 99]

    def completion_ids(self, text, end=True):
        return [5, 6, 99] if end else [5, 6]

    def score(self, sequences):
        return [[-1.0] * len(completion) for _, completion in sequences]


def test_a_rejected_side_cut_at_the_token_budget_gets_no_end_token(tmp_path):
    """Step 3's action was cut at the token budget (``finish_reason = "length"``): its pair's
    rejected side is exactly the sampled tokens; step 1's (stopped normally) ends with the end
    token; step 7's (no tokens in the trace) is rendered and ends with it too."""
    trace = coding_trace("t1")
    trace["turns"][1] |= {"token_ids": [20, 21], "finish_reason": "stop"}
    trace["turns"][3] |= {"token_ids": [10, 11, 12], "finish_reason": "length"}
    apps = {name: fake_teacher_app(fixed(PYTEST)) for name in ("a", "b")}
    with serving(apps) as urls:
        store = replay(make_config(tmp_path, urls), [trace])
    assert reference_pass(store, StubScorer(), max_pair_tokens=100) == 3
    rejected = {p["turn_index"]: json.loads(p["rejected_ids"]) for p in store.pairs()}
    assert rejected == {1: [20, 21, 99], 3: [10, 11, 12], 7: [5, 6, 99]}
    truncated = {p["turn_index"]: json.loads(p["provenance"])["rejected_truncated"] for p in store.pairs()}
    assert truncated == {1: False, 3: True, 7: False}

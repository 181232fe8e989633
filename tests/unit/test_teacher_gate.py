"""The VOI gate's features (hand-computed), its selection, and budgets that hold under concurrency
and across crashes."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading

import pytest

from prime_composer.config.teacher import BudgetConfig, GateConfig
from prime_composer.teacher.budget import Budget, prompt_token_bound
from prime_composer.teacher.gate import StepFeatures, select_steps, step_features
from prime_composer.teacher.store import LedgerRow, TeacherStore
from prime_composer.teacher.traces import TraceSourceConfig, parse_trace


def bash(command, **extra):
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"name": "bash", "arguments": {"command": command}}],
        **extra,
    }


def edit(path, old, new):
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"name": "str_replace", "arguments": {"path": path, "old_str": old, "new_str": new}}],
    }


def tool(content, **extra):
    return {"role": "tool", "content": content, **extra}


def trace_of(*turns):
    return parse_trace(
        {"task": "t", "turns": [{"role": "user", "content": "go"}, *turns]}, "test", TraceSourceConfig()
    )


def features(trace, cfg=None, seen=lambda state, action: False):
    return step_features(trace, cfg or GateConfig(), seen)


def test_uncertainty_is_one_minus_geometric_mean_probability():
    trace = trace_of(
        bash("ls", logprobs=[-0.1, -0.3]), tool("a.py"), {"role": "assistant", "content": "done"}
    )
    f = features(trace, GateConfig(default_uncertainty=0.42))
    assert f[0].uncertainty == pytest.approx(1 - math.exp(-0.2))
    assert f[1].uncertainty == 0.42  # no logprobs in the trace


def test_impact_edits_commands_reads_messages():
    cfg = GateConfig()
    trace = trace_of(
        edit("a.py", "x", "y"), tool("ok"),
        bash("pytest -q"), tool("ok"),
        bash("cat a.py | grep x"), tool("x"),
        bash("git diff"), tool(""),
        bash("cat a.py > b.py"), tool(""),
        {"role": "assistant", "content": "done"},
    )  # fmt: skip
    assert [f.impact for f in features(trace, cfg)] == [
        cfg.impact_edit, cfg.impact_command, cfg.impact_read, cfg.impact_read, cfg.impact_command, cfg.impact_message,
    ]  # fmt: skip


def _window_trace():
    return trace_of(
        bash("ls"), tool("a.py"),                       # step 0: 3 before the first error
        bash("cat a.py"), tool("..."),                  # step 1: 2 before
        edit("a.py", "x", "y"), tool("ok"),             # step 2: 1 before (the planted mistake)
        bash("pytest"), tool("1 failed, 2 passed"),     # step 3: failing tests (pattern)
        bash("make"), tool("boom", exit_code=2),        # step 4: non-zero exit
        bash("ls"), tool("a.py", exit_code=0),          # step 5: fine, 1 after an error
        bash("ls"), tool("a.py"),                       # step 6: 2 after
        bash("ls"), tool("a.py"),                       # step 7: 3 after
    )  # fmt: skip


def test_error_proximity_exit_codes_patterns_and_the_window_around_errors():
    # "proximity": every failing step marks itself (the gate before attribution).
    cfg = GateConfig(error_window=2, error_attribution="proximity")
    errors = [f.error for f in features(_window_trace(), cfg)]
    assert errors == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0, 1.0, 2 / 3, 1 / 3, 0.0])


def test_a_failing_test_run_marks_the_change_that_caused_it():
    # "cause": the failing pytest (step 3, a check) marks the edit before it (step 2; ls and cat only
    # read), `make` failing (step 4, not a check) marks itself. Marked {2, 4}, window 2.
    errors = [f.error for f in features(_window_trace(), GateConfig(error_window=2))]
    assert errors == pytest.approx([1 / 3, 2 / 3, 1.0, 2 / 3, 1.0, 2 / 3, 1 / 3, 0.0])
    cfg = GateConfig(error_window=0)
    # The task's own failing tests (nothing changed before them) mark no step.
    task = trace_of(bash("pytest -q"), tool("1 failed"), bash("cat a.py"), tool("..."))
    assert [f.error for f in features(task, cfg)] == [0.0, 0.0]
    # The latest change is blamed, through reads, `cd` and a pipeline into a read; a command that
    # is neither a read nor a check changes the state too.
    chain = trace_of(
        edit("a.py", "x", "y"), tool("ok"),
        bash("pip install foo"), tool("installed"),
        bash("cat a.py"), tool("..."),
        bash("cd pkg && python -m pytest -q | tail -3"), tool("FAILED test_a.py::test_x"),
    )  # fmt: skip
    assert [f.error for f in features(chain, cfg)] == [0.0, 1.0, 0.0, 0.0]
    # A passing run ("0 failed" is no failure) marks nothing; an answer on a failing run marks itself.
    done = {"role": "assistant", "content": "Fixed."}
    passed = trace_of(
        edit("a.py", "x", "y"), tool("ok"), bash("pytest"), tool("Exit code: 0\n3 passed, 0 failed"), done
    )
    assert [f.error for f in features(passed, cfg)] == [0.0, 0.0, 0.0]
    failed = trace_of(
        edit("a.py", "x", "y"), tool("ok"), bash("pytest"), tool("Exit code: 1\n2 failed"), done
    )
    assert [f.error for f in features(failed, cfg)] == [1.0, 0.0, 1.0]
    # A failing command that is not a check (its own call failed) marks itself, edits included.
    bad = trace_of(edit("a.py", "nope", "y"), tool("old_str not found", is_error=True), done)
    assert [f.error for f in features(bad, cfg)] == [1.0, 1.0]


def test_the_gate_picks_the_wrong_edit_not_the_test_run_that_shows_it():
    """A pyfix episode as the scripted wrong-fix agent plays it (the task's failing tests, read,
    a wrong edit, the tests still fail, "fixed"): with B = 1 and every action equally certain, the
    gate asks the wrong edit; before attribution it asked the first test run (score 0.711 against
    the edit's 0.618)."""

    def call(name, **arguments):
        turn = {"role": "assistant", "content": "", "logprobs": [-0.2] * 8}
        return {**turn, "tool_calls": [{"name": name, "arguments": arguments}]}

    fail = "Exit code: 1\nstdout:\nFAIL test_add: line 5: assert add(2, 3) == 5\n0 passed, 1 failed"
    record = {
        "task": "t",
        "tools": [{"name": n, "parameters": {}} for n in ("run_tests", "read_file", "edit_file")],
        "turns": [
            {"role": "user", "content": "The tests in test_calc.py fail. Fix add in calc.py."},
            call("run_tests"), tool(fail),
            call("read_file", path="calc.py"), tool("def add(a, b):\n    return a - b"),
            call("edit_file", path="calc.py", old_string="a - b", new_string="0"), tool("Edited calc.py"),
            call("run_tests"), tool(fail),
            {"role": "assistant", "content": "Fixed: the tests pass.", "logprobs": [-0.2] * 8},
        ],
    }  # fmt: skip
    trace = parse_trace(record, "test", TraceSourceConfig())
    turns = {name: trace.step_indices[i] for i, name in enumerate(["run", "read", "edit", "rerun", "answer"])}
    for attribution, asked in (("cause", ["edit"]), ("proximity", ["run"])):
        cfg = GateConfig(max_steps_per_trace=1, error_attribution=attribution)
        f = features(trace, cfg)
        assert select_steps(f, [1.0] * len(f), cfg) == [turns[name] for name in asked]


def test_bad_gate_patterns_name_the_field():
    with pytest.raises(ValueError, match=r"teacher.gate.check_commands: '\(' is not a regular expression"):
        GateConfig(check_commands=["("])


def test_reverted_edits_and_the_reverting_step_count_as_errors():
    # Both the edit and the step that undoes it are suspect: one of them was wrong.
    inverse = trace_of(
        edit("a.py", "x", "y"), tool("ok"), bash("ls"), tool("a.py"), edit("./a.py", "y", "x"), tool("ok")
    )
    assert [f.error for f in features(inverse, GateConfig(error_window=0))] == [1.0, 0.0, 1.0]
    checkout = trace_of(
        edit("a.py", "x", "y"),
        tool("ok"),
        edit("b.py", "p", "q"),
        tool("ok"),
        bash("git checkout -- a.py"),
        tool(""),
    )
    assert [f.error for f in features(checkout, GateConfig(error_window=0))] == [1.0, 0.0, 1.0]


def test_an_answer_before_any_tool_ran_counts_as_an_error_where_tools_were_offered():
    def answer_only(tools):
        record = {"task": "t", "tools": tools, "turns": [{"role": "user", "content": "go"}]}
        record["turns"].append({"role": "assistant", "content": "The code looks fine to me."})
        return parse_trace(record, "test", TraceSourceConfig())

    run_tests = [{"name": "run_tests", "description": "run the tests", "parameters": {}}]
    assert [f.error for f in features(answer_only(run_tests), GateConfig(error_window=0))] == [1.0]
    # No tools offered (a plain question): answering at once is all there is to do.
    assert [f.error for f in features(answer_only([]), GateConfig(error_window=0))] == [0.0]
    # A tool ran first: the answer is judged by the errors near it, as before.
    checked = trace_of(bash("pytest"), tool("3 passed"), {"role": "assistant", "content": "done"})
    assert [f.error for f in features(checked, GateConfig(error_window=0))] == [0.0, 0.0]


def test_novelty_and_score():
    trace = trace_of(bash("ls"), tool("a.py"), bash("pytest"), tool("ok"))
    first_state = trace.state_hash(1)
    asked = []
    f = features(trace, seen=lambda state, action: asked.append((state, action)) or state == first_state)
    assert [x.novelty for x in f] == [0.0, 1.0]
    # What is looked up is the state with the trace's own action there.
    assert asked == [(first_state, f[0].action_key), (trace.state_hash(3), f[1].action_key)]
    assert f[0].action_key != f[1].action_key
    cfg = GateConfig(weight_uncertainty=0.5, weight_error=1.0, impact_floor=0.2, seen_state_factor=0.5)
    # evidence = 1 - (1 - 0.5 * 0.5) * (1 - 1.0 * 0.25) = 0.4375; stakes = 0.2 + 0.8 * impact.
    step = StepFeatures(0, "h", uncertainty=0.5, impact=1.0, error=0.25, novelty=1.0)
    assert step.score(cfg) == pytest.approx(0.4375)
    seen_read = StepFeatures(0, "h", uncertainty=0.5, impact=0.5, error=0.25, novelty=0.0)
    assert seen_read.score(cfg) == pytest.approx(0.4375 * 0.6 * 0.5)
    with pytest.raises(ValueError, match="every score is 0"):
        GateConfig(weight_uncertainty=0, weight_error=0)


def test_select_top_b_by_score_per_dollar_in_trace_order():
    cfg = GateConfig(max_steps_per_trace=2, min_score=0.3, weight_error=0, impact_floor=0)
    f = [StepFeatures(i, str(i), u, 1.0, 0, 1.0) for i, u in enumerate([0.9, 0.8, 0.5, 0.2])]  # score = u
    # Step 0 is the best but ten times dearer: 0.09 per dollar against 0.8 and 0.5.
    assert select_steps(f, [10.0, 1.0, 1.0, 0.01], cfg) == [1, 2]
    assert select_steps(f, [1.0] * 4, cfg) == [0, 1]
    assert select_steps(f, [1.0] * 4, cfg.model_copy(update={"enabled": False})) == [0, 1, 2, 3]


# --------------------------------------------------------------------------------------- budget


def test_reservations_hold_the_caps_and_settle_to_the_real_cost():
    budget = Budget(BudgetConfig(per_trace_usd=1.0, per_run_usd=1.5), spent_by_trace={"a": 0.25})
    first = budget.reserve("a", 0.5)
    assert first is not None
    assert budget.reserve("a", 0.3) is None  # 0.25 spent + 0.5 reserved + 0.3 > 1.0
    budget.settle(first, 0.1)  # the call cost less than its worst case
    assert budget.spent("a") == pytest.approx(0.35) and budget.reserve("a", 0.6) is not None
    assert budget.reserve("b", 0.6) is None  # the run: 0.35 + 0.6 reserved + 0.6 > 1.5
    assert budget.reserve("b", 0.5) is not None


def test_concurrent_reservations_never_overshoot():
    budget = Budget(BudgetConfig(per_trace_usd=None, per_run_usd=1.0))
    granted = []

    def worker():
        for _ in range(200):
            r = budget.reserve("t", 1 / 64)  # exact in binary: no rounding at the edge
            if r is not None:
                granted.append(r)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(granted) == 64  # exactly the cap's worth, although 1600 were asked


def test_prompt_bound_is_at_least_bytes():
    messages = [{"role": "user", "content": "héllo"}]
    assert prompt_token_bound(messages, overhead=0) >= len("héllo".encode()) + len("user")


def test_a_refused_call_waits_until_a_call_in_flight_settles():
    async def main() -> None:
        budget = Budget(BudgetConfig(per_trace_usd=None, per_run_usd=1.0))
        first = budget.reserve("t", 0.75)
        assert first is not None
        generation = budget.generation
        assert budget.reserve("t", 0.5) is None  # 0.75 held + 0.5 > 1.0
        waiter = asyncio.create_task(budget.wait_for_release(generation))
        await asyncio.sleep(0.05)
        assert not waiter.done()  # nothing settled yet: it waits
        budget.settle(first, 0.25)  # the call cost a third of what it held
        assert await asyncio.wait_for(waiter, 5) is True
        assert budget.reserve("t", 0.5) is not None  # 0.25 spent + 0.5 <= 1.0
        # A settlement between the refusal and the wait is not missed; nothing in flight: no wait.
        assert await budget.wait_for_release(generation) is True
        idle = Budget(BudgetConfig(per_trace_usd=None, per_run_usd=1.0))
        assert await idle.wait_for_release(idle.generation) is False

    asyncio.run(main())


def test_a_reservation_in_the_store_is_gone_with_its_ledger_row_or_charged_when_orphaned(tmp_path):
    store = TeacherStore(tmp_path / "teacher.sqlite")
    row = LedgerRow("t", 1, "a", "m", "k", 0, 0, 0.004, 0.0, 1, "reserved")
    settled = store.reserve_call(None, row)
    assert store.reserve_call(settled, dataclasses.replace(row, dollars=0.006, attempts=2)) == settled
    store.record_call(dataclasses.replace(row, dollars=0.001, outcome="ok"), reservation_id=settled)
    left = store.reserve_call(None, row)  # a call in flight when the process dies
    assert [r["reservation_id"] for r in store.reservations()] == [left]
    store.close()
    store = TeacherStore(tmp_path / "teacher.sqlite")  # the next process
    assert store.settle_orphans() == (1, 0.004)
    assert store.reservations() == []
    assert [(r["outcome"], r["dollars"]) for r in store.ledger()] == [("ok", 0.001), ("orphaned", 0.004)]
    assert store.spent_by_trace() == {"t": pytest.approx(0.005)}
    store.close()


def _label(store: TeacherStore, trace_id: str, turn_index: int) -> None:
    store.finish_step(
        trace_id, turn_index, status="done", outcome="confirmed", process_reward=None, trace_share=None,
        best_share=None, num_votes=0, votes=[], cost_usd=0.0, pair=None,
    )  # fmt: skip


def test_novelty_is_per_state_and_action(tmp_path):
    """A state labeled before is new again with another action (its answers are cached, a new
    mistake there is a new pair); with the same action it is not."""
    from prime_composer.teacher.store import PlannedStep

    store = TeacherStore(tmp_path / "store.sqlite")
    first = trace_of(bash("pytest -x"))
    store.add_trace(first)
    state, (step,) = first.state_hash(1), features(first)
    store.save_plan(first.trace_id, [PlannedStep(1, state, {}, 1.0, 0.0, True, step.action_key)])
    assert not store.step_evaluated(state, step.action_key)  # planned, not labeled yet
    _label(store, first.trace_id, 1)
    same = features(trace_of(bash("pytest -x")), seen=store.step_evaluated)
    other = features(trace_of(bash("rm -rf tests")), seen=store.step_evaluated)
    assert same[0].state_hash == other[0].state_hash == state
    assert [same[0].novelty, other[0].novelty] == [0.0, 1.0]
    store.close()


def test_a_store_without_step_actions_gains_the_column_and_counts_every_action_seen(tmp_path):
    import sqlite3

    from prime_composer.teacher.store import SCHEMA

    path = tmp_path / "store.sqlite"
    conn = sqlite3.connect(path)  # the steps table as stores wrote it before it kept the action
    conn.executescript(SCHEMA.replace("    action_key TEXT,\n", ""))
    conn.execute("INSERT INTO meta VALUES ('schema_version', '1')")
    conn.execute(
        "INSERT INTO steps (trace_id, turn_index, state_hash, features, score, expected_usd, selected, status)"
        " VALUES ('old', 1, 'S', '{}', 1.0, 0.0, 1, 'done')"
    )
    conn.commit()
    assert "action_key" not in {r[1] for r in conn.execute("PRAGMA table_info(steps)")}
    conn.close()
    store = TeacherStore(path)
    assert store.step_evaluated("S", "any action") and store.step_evaluated("S", "another")
    assert not store.step_evaluated("T", "any action")
    store.close()

"""The progress line shows, for trainer step N, the numbers the metrics files hold for step N.

The orchestrator samples ahead of the trainer (``max_async_level``), so the newest line of
``orchestrator.jsonl`` is usually a later batch than the trainer's newest step; the line once
showed that later batch's reward under the earlier step (step 2 as 0.3125 while the file had
0.70 for step 2).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from prime_composer.launch.progress import Progress


def _write(metrics: Path, process: str, records: list[dict]) -> None:
    metrics.mkdir(parents=True, exist_ok=True)
    (metrics / f"{process}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _printed(line: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in line.split() if "=" in part)


ORCH = [
    {"step": 0, "time": 0.0, "reward/mean": 0.25, "eval/accuracy": 0.5},
    {"step": 1, "time": 1.0, "reward/mean": 0.5},
    {"step": 2, "time": 2.0, "reward/mean": 0.70},
    {"step": 3, "time": 3.0, "reward/mean": 0.3125},  # sampled ahead: the trainer is at step 2
]


def test_each_printed_step_agrees_with_the_metrics_files(tmp_path: Path, capsys) -> None:
    metrics = tmp_path / "metrics"
    progress = Progress(metrics, 10, live=False)
    trainer: list[dict] = []
    orch_by_step = {r["step"]: r for r in ORCH}
    for step in range(3):
        trainer.append({"step": step, "time": float(step), "loss/total": [0.5, 0.25, 0.125][step]})
        _write(metrics, "trainer", trainer)
        # The orchestrator is one batch ahead of the trainer (and the eval of step 2 has landed).
        ahead = [r for r in ORCH if r["step"] <= step + 1]
        if step == 2:
            ahead.insert(3, {"step": 2, "time": 2.5, "eval/accuracy": 0.75})
        _write(metrics, "orchestrator", ahead)
        progress.tick({})
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["0/10", "1/10", "2/10"]
    for step, line in enumerate(lines):
        printed = _printed(line)
        # The reward and loss of this very step, read back from the files.
        assert float(printed["reward"]) == orch_by_step[step]["reward/mean"]
        assert float(printed["loss"]) == trainer[step]["loss/total"]
    # Held-out accuracy: the newest eval at or before the step (evals run every few steps).
    assert [float(_printed(line.replace("eval acc", "eval_acc"))["eval_acc"]) for line in lines] == [
        0.5,
        0.5,
        0.75,
    ]
    assert "0.3125" not in "\n".join(lines)


def test_values_at_a_step_the_orchestrator_has_passed(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics"
    _write(metrics, "trainer", [{"step": 2, "time": 0.0, "loss/total": 0.4}])
    _write(metrics, "orchestrator", ORCH)
    step, shown = Progress(metrics, 10, live=False).values()
    assert step == 2
    assert dict(shown)["reward"] == 0.70
    assert dict(shown)["eval acc"] == 0.5


def test_the_tail_reads_appended_lines_only_and_starts_over_on_a_new_file(tmp_path: Path) -> None:
    from prime_composer.metrics import MetricsLogger, MetricsTail, read_metrics

    path = tmp_path / "metrics" / "teacher.jsonl"
    tail = MetricsTail(path)
    assert tail.read() == []  # no file yet
    logger = MetricsLogger(tmp_path, "teacher")
    for step in range(3):
        logger.log(step, {"teacher/votes": step * 2})
    assert [r["teacher/votes"] for r in tail.read()] == [0, 2, 4]
    with path.open("ab") as f:  # a line being written: not a record yet
        f.write(b'{"step": 3, "teacher/vo')
    assert len(tail.read()) == 3 and tail._offset == path.stat().st_size
    with path.open("ab") as f:
        f.write(b'tes": 6}\n{"step": 4, "teacher/votes": 8}\n')
    assert tail.read() == read_metrics(path) and [r["step"] for r in tail.records] == [0, 1, 2, 3, 4]
    replaced = tmp_path / "new.jsonl"  # a run started over (overwrite): another file at the path
    replaced.write_text(json.dumps({"step": 0, "teacher/votes": 1}) + "\n")
    replaced.replace(path)
    assert tail.read() == [{"step": 0, "teacher/votes": 1}]


def test_the_last_line_shows_the_final_eval_logged_after_the_last_step(tmp_path: Path, capsys) -> None:
    """The final eval runs once the last step's weights are out, after the trainer's last record,
    and is logged under step ``max_steps``: the last line once showed the eval of step 2 instead."""
    metrics = tmp_path / "metrics"
    progress = Progress(metrics, 3, live=False)
    orch = [
        {"step": 0, "time": 0.0, "reward/mean": 0.25, "eval/accuracy": 0.9},
        {"step": 1, "time": 1.0, "reward/mean": 0.5},
        {"step": 2, "time": 2.0, "reward/mean": 0.75, "eval/accuracy": 0.8},
    ]
    trainer = [{"step": s, "time": float(s), "loss/total": 0.1 * (s + 1)} for s in range(3)]
    _write(metrics, "orchestrator", orch)
    _write(metrics, "trainer", trainer)
    progress.tick({})  # the trainer's last step, printed before the final eval exists
    final = {"step": 3, "time": 3.0, "eval/accuracy": 0.6, "eval/pyfix/accuracy": 0.6}
    _write(metrics, "orchestrator", [*orch, final])
    progress.tick({})  # the same trainer step: nothing new to print
    progress.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/3", "3/3"]
    last = _printed(lines[-1].replace("eval acc", "eval_acc"))
    # Exactly the record of step 3: its eval, and no reward or loss (it has none).
    assert float(last["eval_acc"]) == 0.6
    assert "reward" not in last and "loss" not in last
    # Closing again (or a run that ended before any eval after the last step) prints nothing new.
    progress.close()
    assert capsys.readouterr().out == ""


def test_close_without_a_final_eval_prints_nothing_new(tmp_path: Path, capsys) -> None:
    metrics = tmp_path / "metrics"
    _write(metrics, "trainer", [{"step": 2, "time": 0.0, "loss/total": 0.4}])
    _write(metrics, "orchestrator", ORCH)  # its step 3 is a batch sampled ahead, not the run's end
    progress = Progress(metrics, 10, live=False)
    progress.tick({})
    progress.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/10"]


def test_the_log_line_of_an_eval_agrees_with_the_metrics_file(tmp_path: Path, caplog) -> None:
    """The orchestrator's log names the eval's step and accuracies as the file records them."""
    from prime_composer.metrics import MetricsLogger, read_metrics
    from prime_composer.orchestrator.loop import log_metrics

    out = MetricsLogger(tmp_path, "orchestrator")
    with caplog.at_level(logging.INFO, logger="prime_composer.orchestrator.loop"):
        log_metrics(out, 19, {"reward/mean": 0.3125})
        log_metrics(out, 20, {"eval/pyfix/accuracy": 2 / 3, "eval/accuracy": 2 / 3})
    records = read_metrics(tmp_path / "metrics" / "orchestrator.jsonl")
    assert [r["step"] for r in records] == [19, 20]
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["step 20: held-out eval/pyfix/accuracy=0.6667, eval/accuracy=0.6667"]
    assert records[1]["eval/accuracy"] == 2 / 3

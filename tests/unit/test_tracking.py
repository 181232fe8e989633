"""Experiment tracking: the launcher's W&B run, offline, holds exactly the metrics files' numbers
on each process's own step axis and the redacted config; without [wandb] nothing imports wandb."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from prime_composer.config.tracking import WandbConfig
from prime_composer.tracking import MetricsTail, redact, resolve_mode
from prime_composer.tracking.wandb_run import REDACTED


def append(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(text)


def wandb_records(run_file: Path) -> Iterator[object]:
    """The protobuf records of an offline ``run-<id>.wandb`` file: W&B's 7-byte header, then the
    LevelDB log format (32 KiB blocks of ``crc32 | length | type | data`` chunks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def test_tail_takes_whole_lines_and_rereads_a_rewritten_file(tmp_path: Path) -> None:
    tail = MetricsTail(tmp_path)
    append(tmp_path / "trainer.jsonl", '{"step": 0, "loss": 1.0}\n{"step": 1, "lo')
    assert tail.new_records() == [("trainer", {"step": 0, "loss": 1.0})]
    append(tmp_path / "trainer.jsonl", 'ss": 0.5}\nnot json\n')
    assert tail.new_records() == [("trainer", {"step": 1, "loss": 0.5})]
    assert tail.new_records() == []
    (tmp_path / "trainer.jsonl").write_text('{"step": 0, "loss": 2.0}\n')  # trimmed by a resume
    assert tail.new_records() == [("trainer", {"step": 0, "loss": 2.0})]


def test_redact_keeps_names_of_variables_and_hides_values() -> None:
    config = {
        "inference": {"secret_env": "MY_SECRET", "api_key": "sk-123", "port": 8000},
        "teacher": {"pool": [{"api_key_env": "OPENAI_API_KEY", "token": "t0k"}]},
        "password": None,
    }
    assert redact(config) == {
        "inference": {"secret_env": "MY_SECRET", "api_key": REDACTED, "port": 8000},
        "teacher": {"pool": [{"api_key_env": "OPENAI_API_KEY", "token": REDACTED}]},
        "password": None,
    }


def test_auto_mode_is_offline_without_an_api_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WANDB_MODE", "WANDB_API_KEY", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    assert resolve_mode("auto")[0] == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_mode("auto") == ("disabled", "WANDB_MODE")
    assert resolve_mode("offline") == ("offline", "as configured")


@pytest.mark.slow
def test_offline_run_holds_the_metrics_on_each_process_step_axis(tmp_path: Path) -> None:
    from prime_composer.tracking.wandb_run import WandbTracker

    metrics = tmp_path / "metrics"
    append(metrics / "trainer.jsonl", '{"step": 0, "time": 1.0, "loss/total": 0.5, "entropy": null}\n')
    append(metrics / "orchestrator.jsonl", '{"step": 0, "time": 1.0, "reward/mean": 0.25}\n{"step": 1, ')
    config = {"model": {"name": "m"}, "inference": {"secret_env": "S", "api_key": "sk-1"}}
    tracker = WandbTracker(
        WandbConfig(project="proj", name="run-a", tags=["t1"], mode="offline"), tmp_path, config
    )
    tracker.tick()
    append(metrics / "orchestrator.jsonl", '"time": 2.0, "reward/mean": 0.75}\n')
    append(metrics / "trainer.jsonl", '{"step": 1, "time": 2.0, "loss/total": 0.25, "entropy": 3.0}\n')
    tracker.finish()
    assert tracker.num_logged == 4

    (run_file,) = (tmp_path / "wandb").glob("wandb/offline-run-*/run-*.wandb")
    # wandb-core's writer may still be flushing the file when finish() returns (seen under load:
    # the history records arrived a moment later); give it a few seconds to hold all four.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        kinds = [r.WhichOneof("record_type") for r in wandb_records(run_file)]  # type: ignore[attr-defined]
        if kinds.count("history") >= 4:
            break
        time.sleep(0.2)
    history, metric_defs, run = [], {}, None
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")  # type: ignore[attr-defined]
        if kind == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}  # type: ignore[attr-defined]
            history.append({k: v for k, v in items.items() if not k.startswith("_")})
        elif kind == "metric":
            m = record.metric  # type: ignore[attr-defined]
            metric_defs[m.glob_name or m.name] = m.step_metric
        elif kind == "run":
            run = record.run  # type: ignore[attr-defined]
    assert sorted(history, key=lambda h: sorted(h.items())) == sorted(
        [
            {"orchestrator/step": 0, "orchestrator/reward/mean": 0.25},
            {"trainer/step": 0, "trainer/loss/total": 0.5},
            {"orchestrator/step": 1, "orchestrator/reward/mean": 0.75},
            {"trainer/step": 1, "trainer/loss/total": 0.25, "trainer/entropy": 3.0},
        ],
        key=lambda h: sorted(h.items()),
    )
    assert metric_defs["trainer/*"] == "trainer/step" and metric_defs["orchestrator/*"] == "orchestrator/step"
    assert run is not None and (run.project, run.display_name, list(run.tags)) == ("proj", "run-a", ["t1"])
    logged_config = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in run.config.update}
    assert logged_config["inference"] == {"secret_env": "S", "api_key": REDACTED}


@pytest.mark.slow
def test_without_a_wandb_section_nothing_imports_wandb(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from prime_composer.config.resolve import resolve_rl_config\n"
        "import prime_composer.launch.rl, prime_composer.orchestrator.loop, prime_composer.trainer.train\n"
        "from prime_composer.tracking import start_tracker\n"
        "config, _ = resolve_rl_config(['--max-steps', '2'])\n"
        "assert start_tracker(config) is None\n"
        "print('wandb' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert done.stdout.strip() == "False"

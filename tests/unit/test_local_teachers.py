"""Teachers that ``rl`` serves itself: config checks, their SFT data, the launcher's jobs and
servers, and the replay metrics in the progress line and the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from prime_composer.config.errors import ConfigError
from prime_composer.config.inference import InferenceConfig
from prime_composer.config.resolve import resolve_rl_config
from prime_composer.config.sft import SFTConfig
from prime_composer.config.teacher import TeacherEndpointConfig, TeacherServiceConfig
from prime_composer.launch import teachers
from prime_composer.launch.preflight import preflight
from prime_composer.launch.progress import Progress
from prime_composer.report import summary
from prime_composer.teacher.actions import parse_answer
from prime_composer.teacher.sft_data import chat_to_examples, export_teacher_data

REPLAY = Path(__file__).resolve().parents[2] / "configs" / "quickstart-replay.toml"


def test_an_endpoint_needs_base_url_or_local() -> None:
    with pytest.raises(ValidationError, match="give base_url"):
        TeacherEndpointConfig(model="m")
    assert TeacherEndpointConfig(model="m", local={"warmup_steps": 3}).base_url is None
    with pytest.raises(ValidationError, match="warmup_steps"):
        TeacherEndpointConfig(model="m", local={"warmup_steps": -1})


def test_token_ids_are_sent_only_to_agent_teachers() -> None:
    with pytest.raises(ValidationError, match=r"\('m'\)\.send_token_ids: .* set protocol = \"agent\""):
        TeacherEndpointConfig(model="m", base_url="http://x/v1", send_token_ids=True)
    assert TeacherEndpointConfig(model="m", base_url="http://x/v1", protocol="agent", send_token_ids=True)


def test_rl_refuses_a_local_teacher_with_a_base_url_too() -> None:
    pool = '[{name = "a", model = "a", base_url = "http://x/v1", local = {}}]'
    with pytest.raises(ConfigError, match=r"teacher\.pool\[0\] \('a'\) sets both base_url and local"):
        resolve_rl_config(["@", str(REPLAY), "--teacher.pool", pool])


def test_preflight_names_a_missing_teacher_model(tmp_path: Path) -> None:
    pool = f'[{{name = "a", model = "a", local = {{model = {{name = "{tmp_path}/nope"}}}}}}]'
    config, _ = resolve_rl_config(["@", str(REPLAY), "--teacher.pool", pool, "--output-dir", str(tmp_path)])
    with pytest.raises(
        ConfigError, match=r"teacher\.pool\[0\]\.local\.model\.name = '.*nope': no such directory"
    ):
        preflight(config)


def test_chats_become_teacher_prompts_answered_in_the_protocol(tmp_path: Path) -> None:
    instructions = 'Reply {"message": ...}.'
    chat = {
        "messages": [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]
    }
    [example] = chat_to_examples(chat, instructions, "x")
    assert example["messages"] == [
        {"role": "system", "content": instructions},
        {
            "role": "user",
            "content": "### User\nWhat is 2 + 3?\n\n### Next\nWhat is the single best next action? "
            "Reply with one JSON object.",
        },
        {"role": "assistant", "content": '{"message": "5"}'},
    ]
    agent = {
        "messages": [
            {"role": "user", "content": "Fix it."},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "bash", "arguments": '{"command": "ls"}'}}]},
            {"role": "tool", "content": "a.py"},
            {"role": "assistant", "content": "Done."},
        ]
    }  # fmt: skip
    first, second = chat_to_examples(agent, instructions, "x")
    assert json.loads(first["messages"][-1]["content"]) == {"tool": "bash", "arguments": {"command": "ls"}}
    assert "### Agent\n<tool_call>" in second["messages"][1]["content"]
    # What the teacher learns to write is what the service parses back into the same action.
    assert parse_answer(first["messages"][-1]).calls[0].arguments == {"command": "ls"}
    assert parse_answer(second["messages"][-1]).message == "Done."
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps(chat) + "\n" + json.dumps(agent) + "\n")
    config = TeacherServiceConfig(instructions=instructions, pool=[{"model": "m", "local": {}}])
    assert export_teacher_data(config, data, tmp_path / "out.jsonl") == 3
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(ValueError, match=r"chats\.jsonl:1: not a chat the teacher can learn from"):
        export_teacher_data(config, data, tmp_path / "out.jsonl")


def test_the_launcher_fine_tunes_then_serves_each_local_teacher(tmp_path: Path) -> None:
    config, _ = resolve_rl_config(["@", str(REPLAY), "--output-dir", str(tmp_path)])
    (tmp_path / "configs").mkdir()
    data_jobs, sft_jobs = teachers.warmup_specs(config, tmp_path / "configs" / "teacher.json", resuming=False)
    # Agent-protocol teachers learn from the chats the quickstart's warm-up writes, as they are.
    assert data_jobs == []
    assert [s.name for s in sft_jobs] == ["teacher-teacher-a-sft", "teacher-teacher-b-sft"]
    sft = SFTConfig.model_validate_json((tmp_path / "configs" / "teacher-teacher-b-sft.json").read_text())
    assert (sft.max_steps, sft.seed, sft.label_smoothing, sft.optim.lr) == (300, 2, 0.0, 1e-3)
    assert (sft.output_dir, sft.data) == (
        tmp_path / "teachers" / "teacher-b",
        tmp_path / "sft" / "data.jsonl",
    )
    # A resumed run keeps a teacher that finished.
    final = tmp_path / "teachers" / "teacher-a" / "sft" / "final"
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    _, again = teachers.warmup_specs(config, tmp_path / "configs" / "teacher.json", resuming=True)
    assert [s.name for s in again] == ["teacher-teacher-b-sft"]

    servers = teachers.server_specs(config)
    assert [s.name for s in servers] == ["teacher-teacher-a", "teacher-teacher-b"]
    assert config.teacher is not None
    ports = []
    for spec, endpoint in zip(servers, config.teacher.pool, strict=True):
        inference = InferenceConfig.model_validate_json(Path(spec.argv[-1]).read_text())
        assert endpoint.base_url == f"http://127.0.0.1:{inference.port}/v1"
        assert spec.health_url == f"http://127.0.0.1:{inference.port}/health" and spec.kind == "service"
        assert inference.served_model_name == endpoint.model and inference.max_model_len == 128
        assert inference.model.name == str(tmp_path / "teachers" / endpoint.id / "sft" / "final")
        ports.append(inference.port)
    assert len(set(ports)) == 2 and config.inference.port not in ports


def test_review_teachers_learn_from_review_prompts(tmp_path: Path) -> None:
    pool = '[{name = "r", model = "r", local = {warmup_steps = 5}}]'
    config, _ = resolve_rl_config(["@", str(REPLAY), "--output-dir", str(tmp_path), "--teacher.pool", pool])
    (tmp_path / "configs").mkdir()
    data_jobs, [sft_job] = teachers.warmup_specs(
        config, tmp_path / "configs" / "teacher.json", resuming=False
    )
    assert [s.name for s in data_jobs] == ["teacher-data"]
    assert data_jobs[0].argv[-4:] == [
        "--data",
        str(tmp_path / "sft" / "data.jsonl"),
        "--out",
        str(tmp_path / "teachers" / "data.jsonl"),
    ]
    sft = SFTConfig.model_validate_json(Path(sft_job.argv[-1]).read_text())
    assert sft.data == tmp_path / "teachers" / "data.jsonl"


def test_without_warmup_the_teacher_data_is_generated_first(tmp_path: Path) -> None:
    config, _ = resolve_rl_config(["@", str(REPLAY), "--output-dir", str(tmp_path), "--no-warmup.enabled"])
    (tmp_path / "configs").mkdir()
    data_jobs, sft_jobs = teachers.warmup_specs(config, tmp_path / "configs" / "teacher.json", resuming=False)
    assert [s.name for s in data_jobs] == ["teacher-chats"]
    assert "prime_composer.orchestrator.sft_export" in data_jobs[0].argv
    assert (
        SFTConfig.model_validate_json(Path(sft_jobs[0].argv[-1]).read_text()).data
        == tmp_path / "teachers" / "chats.jsonl"
    )


def test_a_teacher_from_the_policy_fine_tunes_the_policys_warmed_up_weights(tmp_path: Path) -> None:
    """``local.from_policy``: the teacher starts from the model the policy starts RL from (what
    ``rl`` sets ``model`` to after the warm-up), not from ``local.model``, which need not exist."""
    pool = (
        '[{name = "a", model = "a", protocol = "agent", local = {from_policy = true, warmup_steps = 5, '
        f'model = {{name = "{tmp_path}/nope"}}}}}}, {{name = "b", model = "b", protocol = "agent", '
        "local = {from_policy = true}}]"
    )
    config, _ = resolve_rl_config(["@", str(REPLAY), "--teacher.pool", pool, "--output-dir", str(tmp_path)])
    preflight(config)  # local.model is not checked: it is not used
    warmed = tmp_path / "sft" / "final"
    config.model = config.model.model_copy(update={"name": str(warmed)})  # as rl's warm-up leaves it
    (tmp_path / "configs").mkdir()
    _, [sft_job] = teachers.warmup_specs(config, tmp_path / "configs" / "teacher.json", resuming=False)
    sft = SFTConfig.model_validate_json(Path(sft_job.argv[-1]).read_text())
    assert (sft.model.name, sft.max_steps) == (str(warmed), 5)
    a, b = (
        InferenceConfig.model_validate_json(Path(spec.argv[-1]).read_text()).model.name
        for spec in teachers.server_specs(config)
    )
    assert a == str(tmp_path / "teachers" / "a" / "sft" / "final")  # its fine-tuned copy
    assert b == str(warmed)  # no warm-up steps: the policy's own starting weights, as they are


def test_agent_replies_are_read_like_the_students_turns() -> None:
    from prime_composer.teacher.actions import ParseError, parse_agent_reply

    assert parse_agent_reply({"content": " 5 "}).key == parse_answer({"content": '{"message": "5"}'}).key
    call = parse_agent_reply(
        {"content": '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'}
    )
    assert call.calls[0].name == "bash" and call.calls[0].arguments == {"command": "ls"}
    with pytest.raises(ParseError):
        parse_agent_reply({"content": "  "})


def write_metrics(output_dir: Path, process: str, records: list[dict]) -> None:
    path = output_dir / "metrics" / f"{process}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_progress_and_report_show_the_replay_metrics_only_when_replay_is_on(tmp_path: Path, capsys) -> None:
    write_metrics(
        tmp_path,
        "trainer",
        [{"step": 1, "time": 0.0, "loss/total": 0.5}, {"step": 2, "time": 4.0, "loss/total": 0.4}],
    )
    write_metrics(
        tmp_path,
        "orchestrator",
        [{"step": 1, "time": 0.0, "reward/mean": 0.1}, {"step": 2, "time": 1.0, "reward/mean": 0.2}],
    )
    plain = Progress(tmp_path / "metrics", 10, live=False)
    assert [label for label, _ in plain.values()[1]] == ["reward", "loss"]
    assert "replay" not in summary(tmp_path) and "teachers" not in summary(tmp_path)

    write_metrics(tmp_path, "orchestrator", [
        {"step": 1, "time": 0.0, "reward/mean": 0.1, "replay/pairs": 0},
        {"step": 2, "time": 1.0, "reward/mean": 0.2, "replay/pairs": 6},
    ])  # fmt: skip
    write_metrics(tmp_path, "teacher", [
        {"step": 7, "time": 0.0, "teacher/spent_usd": 0.0123, "teacher/agreement_rate": 0.25,
         "teacher/votes": 40, "teacher/calls_paid": 30, "teacher/steps_pair": 9, "teacher/steps_confirmed": 3},
    ])  # fmt: skip
    progress = Progress(tmp_path / "metrics", 10, live=False)
    assert progress.values()[1] == [
        ("reward", 0.2),
        ("loss", 0.4),
        ("pairs", 6),
        ("spend $", 0.0123),
        ("agree", 0.25),
    ]
    progress.tick({})
    assert "pairs=6 spend $=0.0123 agree=0.25" in capsys.readouterr().out
    text = summary(tmp_path)
    assert "replay: 6 pairs in 2 steps (3.0 per step, 1 steps with pairs)" in text
    assert "teachers: $0.0123 spent on 30 calls, 40 votes, agreement with the policy 0.25" in text


def test_the_service_alone_refuses_a_local_teacher_nobody_serves(tmp_path: Path) -> None:
    from prime_composer.teacher.budget import Budget
    from prime_composer.teacher.pool import TeacherPool
    from prime_composer.teacher.store import TeacherStore

    cfg = TeacherServiceConfig(output_dir=tmp_path, pool=[{"name": "a", "model": "a", "local": {}}])
    store = TeacherStore(cfg.store_path)
    with pytest.raises(
        ValueError, match=r"teacher\.pool\[0\] \('a'\) has no base_url: a `local` teacher is started by `rl`"
    ):
        TeacherPool(cfg.pool, cfg.budget, store, Budget(cfg.budget, {}))
    store.close()


def test_builtin_tiny_shapes_are_parsed_and_checked() -> None:
    from prime_composer.model.resolve import tiny_spec_overrides

    assert tiny_spec_overrides("builtin:tiny-qwen3") == {}
    assert tiny_spec_overrides("builtin:tiny-qwen3?num_hidden_layers=4&seed=2") == {
        "num_hidden_layers": 4,
        "seed": 2,
    }
    for bad, message in [
        ("builtin:tiny-qwen4", "unknown built-in model"),
        ("builtin:tiny-qwen3?layers=4", "layers=4 is not a shape of the tiny model"),
        ("builtin:tiny-qwen3?seed=x", "seed=x is not a shape"),
        ("builtin:tiny-qwen3?seed", r"\?field=value"),
    ]:
        with pytest.raises(ValueError, match=message):
            tiny_spec_overrides(bad)


def test_teacher_nice_lowers_the_teachers_servers_and_the_service(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    base = os.nice(0)
    config, _ = resolve_rl_config(["@", str(REPLAY), "--output-dir", str(tmp_path), "--teacher.nice", "4"])
    (tmp_path / "configs").mkdir()
    servers = teachers.server_specs(config)
    assert len(servers) == 2
    for spec in servers:
        # The prefix execs the server: run it in front of a process that reports its niceness.
        prefix = spec.argv[: spec.argv.index(sys.executable)]
        shown = subprocess.run(
            [*prefix, sys.executable, "-c", "import os; print(os.nice(0))"], capture_output=True, text=True
        )
        assert int(shown.stdout) == min(base + 4, 19)
    config0, _ = resolve_rl_config(["@", str(REPLAY), "--output-dir", str(tmp_path), "--teacher.nice", "0"])
    assert all(s.argv[0] == sys.executable for s in teachers.server_specs(config0))
    # The service lowers itself before it starts (run_service replaced by a probe of the niceness).
    probe = (
        "import os, sys\n"
        "import prime_composer.teacher.service as service\n"
        "from prime_composer.config.teacher import TeacherServiceConfig\n"
        "from prime_composer.teacher import main\n"
        "service.run_service = lambda config: print(os.nice(0)) or 0\n"
        f"main.run(TeacherServiceConfig(nice=3, output_dir={str(tmp_path)!r}, "
        "pool=[{'model': 'm', 'base_url': 'http://127.0.0.1:9/v1'}]))\n"
    )
    shown = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert int(shown.stdout.split()[-1]) == min(base + 3, 19)

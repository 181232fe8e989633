"""The ``@ file.toml`` command line: precedence, scoping, includes, shared keys, and errors.

Every malformed input must give a one-line-per-problem message that names where the value came
from and the dotted key, exit 2, and print no traceback.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from prime_composer.config.errors import ConfigError
from prime_composer.config.resolve import resolve_rl_config


def write(tmp_path: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)


def resolve(tmp_path: Path, argv: list[str], monkeypatch: pytest.MonkeyPatch | None = None):
    if monkeypatch is not None:
        monkeypatch.chdir(tmp_path)
    return resolve_rl_config(argv)[0]


# --------------------------------------------------------------------------------------- precedence


def test_precedence_cli_over_later_file_over_earlier_file_over_env_over_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(
        tmp_path,
        {"a.toml": "max_steps = 5\nseed = 1\nmax_async_level = 3\n", "b.toml": "max_steps = 6\nseed = 2\n"},
    )
    monkeypatch.setenv("PRIME_COMPOSER_MAX_STEPS", "4")
    monkeypatch.setenv("PRIME_COMPOSER_OUTPUT_DIR", "from-env")
    monkeypatch.setenv("PRIME_COMPOSER_TRAINER__NUM_RANKS", "2")
    cfg = resolve(tmp_path, ["@", "a.toml", "@", "b.toml", "--seed", "9"], monkeypatch)
    assert cfg.seed == 9  # CLI beats both files
    assert cfg.max_steps == 6  # later file beats earlier file and env
    assert cfg.max_async_level == 3  # earlier file beats default
    assert str(cfg.output_dir) == "from-env"  # env beats default
    assert cfg.trainer.num_ranks == 2  # nested env var
    assert cfg.launch.progress is True  # default


def test_flag_before_file_still_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, {"a.toml": "max_steps = 5\n"})
    assert resolve(tmp_path, ["--max-steps", "8", "@", "a.toml"], monkeypatch).max_steps == 8


def test_section_scoped_files_and_shared_keys_propagate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(
        tmp_path,
        {
            "t.toml": "max_steps = 7\nnum_ranks = 2\n[model]\nname = 'my/model'\n",
            "o.toml": "max_steps = 7\nbatch_size = 16\n",
            "i.toml": "port = 8123\n",
        },
    )
    cfg = resolve(
        tmp_path,
        ["--trainer", "@", "t.toml", "--orchestrator", "@", "o.toml", "--inference", "@", "i.toml"],
        monkeypatch,
    )
    assert cfg.max_steps == cfg.trainer.max_steps == cfg.orchestrator.max_steps == 7
    assert cfg.model.name == cfg.orchestrator.model.name == cfg.inference.model.name == "my/model"
    assert cfg.trainer.num_ranks == 2 and cfg.orchestrator.batch_size == 16
    assert cfg.orchestrator.base_url == "http://127.0.0.1:8123/v1"


def test_top_level_shared_key_reaches_every_section(tmp_path: Path) -> None:
    cfg = resolve(tmp_path, ["--model.name", "x/y", "--output-dir", "out/z", "--ckpt.interval", "3"])
    for section in (cfg.trainer, cfg.orchestrator, cfg.inference):
        assert section.model.name == "x/y"
        assert str(section.output_dir) == "out/z"
    assert cfg.trainer.ckpt.interval == cfg.orchestrator.ckpt.interval == 3


def test_section_may_repeat_the_same_shared_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, {"a.toml": "max_steps = 5\n[trainer]\nmax_steps = 5\n"})
    assert resolve(tmp_path, ["@", "a.toml"], monkeypatch).trainer.max_steps == 5


def test_include_is_overridden_by_the_including_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(
        tmp_path,
        {
            "base/common.toml": "max_steps = 3\nseed = 4\n[trainer]\nnum_ranks = 2\n",
            "run.toml": "include = ['base/common.toml']\nmax_steps = 10\n",
        },
    )
    cfg = resolve(tmp_path, ["@", "run.toml"], monkeypatch)
    assert (cfg.max_steps, cfg.seed, cfg.trainer.num_ranks) == (10, 4, 2)


def test_booleans_kebab_case_and_equals_form(tmp_path: Path) -> None:
    cfg = resolve(
        tmp_path,
        ["--no-launch.progress", "--ckpt.at-end=false", "--launch.health-timeout-s=12.5", "--resume"],
    )
    assert cfg.launch.progress is False and cfg.ckpt.at_end is False
    assert cfg.launch.health_timeout_s == 12.5
    assert cfg.ckpt.resume and cfg.trainer.ckpt.resume and cfg.orchestrator.ckpt.resume


def test_json_config_of_a_process_round_trips(tmp_path: Path) -> None:
    cfg = resolve(tmp_path, ["--max-steps", "11"])
    (tmp_path / "rl.json").write_text(json.dumps(cfg.model_dump(mode="json")))
    again = resolve(tmp_path, ["@", str(tmp_path / "rl.json")])
    assert again.model_dump() == cfg.model_dump()


# ------------------------------------------------------------------------------------------ errors

BAD_CASES: list[tuple[str, dict[str, str], list[str], list[str]]] = [
    # (id, files, argv, substrings the message must contain)
    (
        "unknown top key in file",
        {"a.toml": "max_stepz = 3\n"},
        ["@", "a.toml"],
        ["a.toml", "max_stepz", "did you mean 'max_steps'"],
    ),
    (
        "unknown nested key in file",
        {"a.toml": "[trainer]\nnum_rank = 2\n"},
        ["@", "a.toml"],
        ["a.toml", "trainer.num_rank", "trainer.num_ranks"],
    ),
    (
        "unknown section in file",
        {"a.toml": "[trainr]\nx = 1\n"},
        ["@", "a.toml"],
        ["a.toml", "trainr", "did you mean 'trainer'"],
    ),
    (
        "unknown key deep in file",
        {"a.toml": "[ckpt]\nintervall = 2\n"},
        ["@", "a.toml"],
        ["ckpt.intervall", "ckpt.interval"],
    ),
    (
        "unknown key in scoped file",
        {"t.toml": "num_rank = 2\n"},
        ["--trainer", "@", "t.toml"],
        ["t.toml", "trainer.num_rank", "trainer.num_ranks"],
    ),
    ("unknown flag", {}, ["--max-stepz", "3"], ["--max-stepz", "max_stepz", "max_steps"]),
    ("unknown nested flag", {}, ["--trainer.num-rank", "3"], ["trainer.num_rank", "trainer.num_ranks"]),
    ("unknown section flag", {}, ["--orchestratr.batch-size", "3"], ["orchestratr", "orchestrator"]),
    ("flag into a value", {}, ["--max-steps.x", "3"], ["max_steps", "is a value"]),
    ("wrong type flag", {}, ["--max-steps", "abc"], ["--max-steps", "max_steps = 'abc'", "integer"]),
    (
        "wrong type in file",
        {"a.toml": "seed = 'zero'\n"},
        ["@", "a.toml"],
        ["a.toml", "seed = 'zero'", "integer"],
    ),
    ("float into int", {"a.toml": "max_steps = 2.5\n"}, ["@", "a.toml"], ["a.toml", "max_steps = 2.5"]),
    (
        "bool wrong",
        {"a.toml": "[launch]\nprogress = 'maybe'\n"},
        ["@", "a.toml"],
        ["launch.progress = 'maybe'", "boolean"],
    ),
    ("below minimum", {}, ["--max-steps", "0"], ["max_steps = 0", "greater than or equal to 1"]),
    ("negative", {}, ["--ckpt.keep", "-1"], ["ckpt.keep = -1"]),
    ("port range", {}, ["--inference.port", "70000"], ["inference.port = 70000"]),
    ("bad literal", {}, ["--model.dtype", "fp8"], ["model.dtype = 'fp8'", "'bfloat16'"]),
    (
        "bad literal in file",
        {"a.toml": "[inference]\nbackend = 'tgi'\n"},
        ["@", "a.toml"],
        ["a.toml", "inference.backend = 'tgi'", "'vllm'"],
    ),
    ("table for value", {"a.toml": "[seed]\nx = 1\n"}, ["@", "a.toml"], ["a.toml", "seed"]),
    ("value for table", {"a.toml": "trainer = 3\n"}, ["@", "a.toml"], ["a.toml", "trainer = 3"]),
    ("env wrong type", {}, [], ["environment variable PRIME_COMPOSER_MAX_STEPS", "max_steps = 'many'"]),
    ("missing file", {}, ["@", "nope.toml"], ["nope.toml", "no such file"]),
    ("directory as file", {"d/x.toml": ""}, ["@", "d"], ["'d'", "directory"]),
    (
        "invalid toml",
        {"a.toml": "max_steps = = 3\n"},
        ["@", "a.toml"],
        ["a.toml", "not valid TOML", "line 1"],
    ),
    ("invalid json", {"a.json": "{max_steps: 3}"}, ["@", "a.json"], ["a.json", "not valid JSON"]),
    (
        "missing include",
        {"a.toml": "include = ['gone.toml']\n"},
        ["@", "a.toml"],
        ["a.toml (include)", "gone.toml"],
    ),
    (
        "include cycle",
        {"a.toml": "include = ['b.toml']\n", "b.toml": "include = ['a.toml']\n"},
        ["@", "a.toml"],
        ["include cycle"],
    ),
    ("bad include type", {"a.toml": "include = 3\n"}, ["@", "a.toml"], ["a.toml", "include = 3"]),
    ("at without path", {}, ["@"], ["'@' must be followed"]),
    ("flag without value", {}, ["--max-steps"], ["missing value for --max-steps"]),
    ("flag followed by flag", {}, ["--seed", "--max-steps", "3"], ["missing value for --seed"]),
    ("positional", {}, ["quickstart.toml"], ["unexpected argument 'quickstart.toml'", "@ file.toml"]),
    (
        "file for a value",
        {"a.toml": "x = 1\n"},
        ["--seed", "@", "a.toml"],
        ["seed", "only be given for a section"],
    ),
    (
        "shared key conflict top vs section",
        {"a.toml": "max_steps = 5\n[trainer]\nmax_steps = 6\n"},
        ["@", "a.toml"],
        ["trainer.max_steps = 6", "max_steps = 5", "set it once at the top level"],
    ),
    (
        "shared key conflict between sections",
        {"t.toml": "max_steps = 5\n", "o.toml": "max_steps = 6\n"},
        ["--trainer", "@", "t.toml", "--orchestrator", "@", "o.toml"],
        ["orchestrator.max_steps = 6", "trainer.max_steps = 5", "o.toml"],
    ),
    (
        "nested shared conflict",
        {},
        ["--model.name", "a/b", "--inference.model.name", "c/d"],
        ["inference.model.name = 'c/d'", "model.name = 'a/b'"],
    ),
    (
        "base_url conflict",
        {},
        ["--orchestrator.base-url", "http://127.0.0.9:1/v1"],
        ["command line (--orchestrator.base-url)", "orchestrator.base_url", "remove orchestrator.base_url"],
    ),
    ("no- on non-bool", {}, ["--no-max-steps"], ["--no-max-steps", "'max_steps' is not a boolean"]),
    # Accepted but wrong once: each is now a one-line error before anything starts.
    (
        "boolean for a number",
        {"a.toml": "max_steps = true\n"},
        ["@", "a.toml"],
        ["a.toml", "max_steps", "boolean"],
    ),
    ("infinite lr", {}, ["--trainer.optim.lr", "inf"], ["trainer.optim.lr = inf", "finite"]),
    ("nan weight", {}, ["--trainer.loss.sdpo.weight", "nan"], ["trainer.loss.sdpo.weight", "finite"]),
    ("negative seed", {}, ["--seed", "-1"], ["seed = -1", "greater than or equal to 0"]),
    ("seed beyond 64 bits", {}, ["--seed", str(2**70)], ["seed", "less than 9223372036854775808"]),
    (
        "greedy training",
        {},
        ["--orchestrator.sampling.temperature", "0"],
        ["temperature = 0 (greedy)", "eval"],
    ),
    ("tiny top_p", {}, ["--orchestrator.sampling.top-p", "1e-9"], ["top_p = 1e-09", "top_p >= 0.05"]),
    (
        "huge eps_high",
        {},
        ["--trainer.loss.rl.eps-high", "1e6"],
        ["trainer.loss.rl.eps_high", "less than or equal to 10"],
    ),
    (
        "empty stop string",
        {},
        ["--orchestrator.sampling.stop", '[""]'],
        ["orchestrator.sampling.stop", "empty stop"],
    ),
    (
        "batch not a multiple of the group",
        {},
        ["--orchestrator.batch-size", "9", "--orchestrator.group-size", "4"],
        ["batch_size (9) must be a multiple of orchestrator.group_size (4)", "batch_size = 8"],
    ),
    ("group of one", {}, ["--orchestrator.group-size", "1"], ["group_size = 1", "advantage 0"]),
    (
        "in-flight bound below a group",
        {},
        [
            "--orchestrator.max-inflight",
            "2",
            "--orchestrator.group-size",
            "4",
            "--orchestrator.batch-size",
            "8",
        ],
        ["max_inflight = 2", "at least 4"],
    ),
    (
        "section table inside a scoped file",
        {"t.toml": "[orchestrator]\nbatch_size = 8\n"},
        ["--trainer", "@", "t.toml"],
        ["t.toml", "[orchestrator] is a section of the whole config", "--orchestrator @ file"],
    ),
]


@pytest.mark.parametrize("files, argv, expected", [c[1:] for c in BAD_CASES], ids=[c[0] for c in BAD_CASES])
def test_bad_input_gives_a_clear_error(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    files: dict[str, str],
    argv: list[str],
    expected: list[str],
) -> None:
    write(tmp_path, files)
    if not argv:
        monkeypatch.setenv("PRIME_COMPOSER_MAX_STEPS", "many")
    with pytest.raises(ConfigError) as info:
        resolve(tmp_path, argv, monkeypatch)
    message = str(info.value)
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"
    assert "Traceback" not in message and "pydantic" not in message.lower()


def test_there_are_at_least_30_bad_cases() -> None:
    assert len(BAD_CASES) >= 30


def test_console_script_prints_one_line_and_exits_2(tmp_path: Path) -> None:
    (tmp_path / "a.toml").write_text("[trainer]\nnum_rank = 2\n")
    proc = subprocess.run(
        [sys.executable, "-m", "prime_composer.launch.rl", "@", str(tmp_path / "a.toml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert (
        len(lines) == 1 and "trainer.num_rank" in lines[0] and "did you mean 'trainer.num_ranks'" in lines[0]
    )


def test_help_lists_every_field_with_its_docstring_and_default() -> None:
    from prime_composer.config.help import render_help
    from prime_composer.config.rl import RLConfig

    text = render_help(RLConfig, prog="rl")
    assert "--trainer.num_ranks INT  [default: 1]" in text
    assert "Data-parallel ranks" in text
    assert "--launch.progress / --no-launch.progress" in text


def test_dry_run_prints_resolved_config(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "prime_composer.launch.rl",
            "@",
            str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.toml"),  # preflight passes
            "--dry-run",
            "--max-steps",
            "4",
            "--inference.port",
            "8111",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    resolved = json.loads(proc.stdout)
    assert resolved["trainer"]["max_steps"] == 4
    assert resolved["orchestrator"]["base_url"] == "http://127.0.0.1:8111/v1"


ENV_CASES = [
    (
        "PRIME_COMPOSER_MAX_STEPZ",
        "3",
        ["environment variable PRIME_COMPOSER_MAX_STEPZ", "did you mean 'max_steps'"],
    ),
    (
        "PRIME_COMPOSER_TRAINER__OPTIM__LRR",
        "1e-5",
        ["PRIME_COMPOSER_TRAINER__OPTIM__LRR", "trainer.optim.lr"],
    ),
    (
        "PRIME_COMPOSER_TRAINER",
        "{bad json",
        ["environment variable PRIME_COMPOSER_TRAINER", "not valid JSON"],
    ),
    ("PRIME_COMPOSER_MAX_STEPS", "true", ["PRIME_COMPOSER_MAX_STEPS", "where an integer is expected"]),
]


@pytest.mark.parametrize("name, value, expected", ENV_CASES, ids=[c[0] for c in ENV_CASES])
def test_bad_environment_variables_at_any_depth(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, value: str, expected: list[str]
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        resolve(tmp_path, [], monkeypatch)
    for part in expected:
        assert part in str(info.value), f"{part!r} not in {info.value!r}"


def test_variables_that_are_not_config_keys_are_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PRIME_COMPOSER_INFERENCE_API_KEY", "x")
    monkeypatch.setenv("PRIME_COMPOSER_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("PRIME_COMPOSER_CACHE", str(tmp_path))
    monkeypatch.setenv("PRIME_COMPOSER_TRAINER__OPTIM__LR", "3e-4")
    assert resolve(tmp_path, [], monkeypatch).trainer.optim.lr == 3e-4


def test_non_utf8_file_and_deep_include_chain_are_one_line_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "bad.toml").write_bytes(b"max_steps = 3 # \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: not UTF-8 text \(byte \d+"):
        resolve(tmp_path, ["@", "bad.toml"], monkeypatch)
    for i in range(1200):
        body = f'include = ["c{i + 1}.toml"]\n' if i < 1199 else "max_steps = 2\n"
        (tmp_path / f"c{i}.toml").write_text(body)
    with pytest.raises(ConfigError, match="included 32 files deep"):
        resolve(tmp_path, ["@", "c0.toml"], monkeypatch)

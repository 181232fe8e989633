"""Mistakes that used to surface minutes after launch are caught before any process starts."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from prime_composer.config.errors import ConfigError
from prime_composer.config.ports import free_port
from prime_composer.config.resolve import resolve_rl_config
from prime_composer.launch.preflight import preflight

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "configs" / "quickstart.toml")


def check(argv: list[str]) -> str:
    config, _ = resolve_rl_config(["@", QUICKSTART, *argv])
    with pytest.raises(ConfigError) as info:
        preflight(config)
    return str(info.value)


@pytest.fixture(autouse=True)
def in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # local environments are found relative to the working directory


def test_the_shipped_quickstart_passes(tmp_path: Path) -> None:
    config, _ = resolve_rl_config(["@", QUICKSTART, "--inference.port", str(free_port("127.0.0.1", set()))])
    preflight(config)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--model.name", "/no/such/model"], "model.name = '/no/such/model': no such directory"),
        (["--model.name", "./relative/dir"], "no such directory"),
        (
            ["--orchestrator.env", "[{id = 'no-such-env'}]"],
            "orchestrator.env[0].id = 'no-such-env': no such environment",
        ),
        (["--inference.secret-env", "PC_UNSET_SECRET_VAR"], "inference.secret_env = 'PC_UNSET_SECRET_VAR'"),
        (["--inference.host", "0.0.0.0"], "reachable from other machines: set inference.secret_env"),
        (["--warmup.data", "/no/such/data.jsonl"], "warmup.data = '/no/such/data.jsonl': no such file"),
    ],
)
def test_each_mistake_is_named(argv: list[str], expected: str) -> None:
    assert expected in check(["--inference.port", str(free_port("127.0.0.1", set())), *argv])


def test_a_taken_port(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert f"inference.port = {port}: cannot listen" in check(["--inference.port", str(port)])


def test_a_model_file_or_a_directory_without_config(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"x")
    assert "is a file" in check(["--model.name", str(tmp_path / "weights.bin")])
    assert "has no config.json" in check(["--model.name", str(tmp_path)])


def test_several_mistakes_at_once_and_the_launcher_exits_2_before_starting(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "prime_composer.launch.rl", "@", QUICKSTART, "--output-dir", str(out),
         "--model.name", "/no/such/model", "--orchestrator.env", "[{id = 'nope'}]"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "/no/such/model" in proc.stderr and "'nope'" in proc.stderr and "Traceback" not in proc.stderr
    assert not (out / "logs").exists()  # nothing was started


def test_smollm2_builtin_names_its_gguf_file_and_needs_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prime_composer.model import resolve as resolve_module
    from prime_composer.model import smollm2

    config, _ = resolve_rl_config(
        [
            "@",
            QUICKSTART,
            "--inference.port",
            str(free_port("127.0.0.1", set())),
            "--model.name",
            "builtin:smollm2-135m-instruct",
        ]
    )
    assert config.model.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    # An explicit file is kept.
    other, _ = resolve_rl_config(
        ["@", QUICKSTART, "--model.name", "builtin:smollm2-135m-instruct", "--model.gguf-file", "x.gguf"]
    )
    assert other.model.gguf_file == "x.gguf"
    # Without the gguf package the launch stops before any process starts, saying how to get it.
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name, *a)
    )
    with pytest.raises(ConfigError, match=r"needs the gguf package: uv sync --extra smollm2"):
        preflight(config)
    # The name resolves to the cached folder holding the file (no download when it is there).
    cached = tmp_path / "smollm2"
    cached.mkdir()
    (cached / smollm2.GGUF_FILE).write_bytes(b"GGUF")
    monkeypatch.setattr(smollm2, "default_cache_dir", lambda: tmp_path)
    assert resolve_module.resolve_model_name("builtin:smollm2-135m-instruct") == str(cached)
    # Every process reads the tokenizer from the GGUF file too (the orchestrator, the agent harness).
    import transformers

    calls = []
    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", lambda path, **kw: calls.append((path, kw))
    )
    resolve_module.load_tokenizer("builtin:smollm2-135m-instruct")
    resolve_module.load_tokenizer(str(cached), gguf_file="other.gguf", revision="main")
    assert calls == [
        (str(cached), {"gguf_file": smollm2.GGUF_FILE}),
        (str(cached), {"revision": "main", "gguf_file": "other.gguf"}),
    ]

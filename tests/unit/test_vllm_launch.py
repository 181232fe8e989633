"""The vllm backend's launcher (inference/vllm/launch.py) and worker extension, without vLLM.

The command line is checked option by option; ``serve_vllm`` is run for real against a fake
"vLLM" (a script that serves ``/health`` and starts a grandchild), to check that SIGTERM stops
the whole process group and that a vLLM that dies on its own is an error, not a silent exit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import prime_composer
from prime_composer.config.inference import InferenceConfig, VLLMConfig
from prime_composer.config.ports import free_port
from prime_composer.inference.vllm import extension
from prime_composer.inference.vllm.admin import SETTINGS_ENV
from prime_composer.inference.vllm.launch import (
    EXTENSION_CLS,
    MIDDLEWARE,
    build_vllm_command,
    build_vllm_env,
    check_extra_args,
    resolve_python,
)
from prime_composer.transport.weights import publish_weights


def _config(tmp_path: Path, **overrides: object) -> InferenceConfig:
    base: dict[str, object] = {
        "backend": "vllm",
        "port": 8123,
        "output_dir": str(tmp_path / "run"),
        "model": {"name": "org/model", "dtype": "bfloat16", "revision": "abc"},
        "seed": 7,
    }
    base.update(overrides)
    return InferenceConfig.model_validate(base)


def _options(argv: list[str]) -> dict[str, str | bool]:
    """``--opt value`` pairs and bare ``--flag``s of an argv (after ``-m module``)."""
    options: dict[str, str | bool] = {}
    i = 3
    while i < len(argv):
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            options[argv[i]] = argv[i + 1]
            i += 2
        else:
            options[argv[i]] = True
            i += 1
    return options


def test_command_line(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        max_model_len=4096,
        served_model_name="policy",
        vllm={
            "tensor_parallel_size": 2,
            "gpu_memory_utilization": 0.8,
            "enforce_eager": True,
            "extra_args": ["--max-num-seqs", "64"],
        },
    )
    argv = build_vllm_command(config, "/models/x")
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert _options(argv) == {
        "--model": "/models/x",
        "--served-model-name": "policy",
        "--host": "127.0.0.1",
        "--port": "8123",
        "--seed": "7",
        "--dtype": "bfloat16",
        "--revision": "abc",
        "--tensor-parallel-size": "2",
        "--worker-extension-cls": EXTENSION_CLS,
        "--middleware": MIDDLEWARE,
        "--logprobs-mode": "processed_logprobs",
        "--generation-config": "vllm",
        "--max-model-len": "4096",
        "--gpu-memory-utilization": "0.8",
        "--enforce-eager": True,
        "--enable-auto-tool-choice": True,
        "--tool-call-parser": "hermes",
        "--max-num-seqs": "64",
    }


def test_defaults_serve_under_the_model_name_and_leave_vllm_defaults(tmp_path: Path) -> None:
    config = _config(tmp_path, model={"name": "org/model"})
    options = _options(build_vllm_command(config, "/models/x"))
    assert options["--served-model-name"] == "org/model"
    assert options["--dtype"] == "auto"
    for unset in ("--max-model-len", "--gpu-memory-utilization", "--enforce-eager", "--revision"):
        assert unset not in options


def test_classes_named_on_the_command_line_exist() -> None:
    import importlib

    for qualname in (EXTENSION_CLS, MIDDLEWARE):
        module, _, name = qualname.rpartition(".")
        assert isinstance(getattr(importlib.import_module(module), name), type)


@pytest.mark.parametrize(
    ("arg", "names"),
    [
        ("--port", "inference.port"),
        ("--max_model_len=100", "inference.max_model_len"),
        ("--no-enforce-eager", "inference.vllm.enforce_eager"),
        ("--middleware", "set by the backend"),
        ("--logprobs-mode=raw_logprobs", "set by the backend"),
        ("-tp", "tensor_parallel_size"),
        ("--tool-call-parser=llama3_json", "inference.tool_call_parser"),
        ("--enable-auto-tool-choice", "inference.tool_call_parser"),
        ("--ssl-certfile=c.pem", "inference.tls_cert"),
        ("--ssl_keyfile", "inference.tls_key"),
    ],
)
def test_extra_args_may_not_override_the_backend(arg: str, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        check_extra_args(["--max-num-seqs", "8", arg])


def test_gguf_and_missing_interpreter_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="gguf_file"):
        build_vllm_command(_config(tmp_path, model={"name": "x", "gguf_file": "m.gguf"}), "x")
    with pytest.raises(ValueError, match=r"setup\.sh"):
        resolve_python(_config(tmp_path, vllm={"python": str(tmp_path / "nowhere")}))
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    assert resolve_python(_config(tmp_path, vllm={"python": str(venv)})) == venv / "bin" / "python"


def test_client_chat_templates_need_the_config_flag(tmp_path: Path) -> None:
    assert "--trust-request-chat-template" not in build_vllm_command(_config(tmp_path), "/m")
    allowed = build_vllm_command(_config(tmp_path, allow_client_chat_template=True), "/m")
    assert "--trust-request-chat-template" in allowed
    with pytest.raises(ValueError, match="allow_client_chat_template"):
        check_extra_args(["--trust-request-chat-template"])


def test_tls_serves_https_with_the_configured_files(tmp_path: Path) -> None:
    assert "--ssl-certfile" not in build_vllm_command(_config(tmp_path), "/m")
    cert, key = tmp_path / "tls" / "cert.pem", tmp_path / "tls" / "key.pem"
    options = _options(build_vllm_command(_config(tmp_path, tls_cert=str(cert), tls_key=str(key)), "/m"))
    assert options["--ssl-certfile"] == str(cert) and options["--ssl-keyfile"] == str(key)
    # off loopback the vllm backend needs TLS (or the private-network flag), as the hf backend does
    with pytest.raises(ValueError, match=r"inference\.host = '10\.0\.0\.2'.*plain HTTP"):
        _config(tmp_path, host="10.0.0.2", secret_env="S")
    assert _config(tmp_path, host="10.0.0.2", secret_env="S", tls_cert=str(cert), tls_key=str(key)).tls_cert


def test_tool_call_parser_names_vllms_parser_of_the_same_format(tmp_path: Path) -> None:
    options = _options(build_vllm_command(_config(tmp_path, tool_call_parser="hermes"), "/m"))
    assert options["--tool-call-parser"] == "hermes" and options["--enable-auto-tool-choice"] is True
    off = build_vllm_command(_config(tmp_path, tool_call_parser="none"), "/m")
    assert "--tool-call-parser" not in off and "--enable-auto-tool-choice" not in off


def test_environment_carries_admin_settings_but_not_the_secret(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        secret_env="MY_SECRET",
        max_request_bytes=4096,
        vllm={"env": {"VLLM_CPU_KVCACHE_SPACE": "2"}},
    )
    env = build_vllm_env(config, base_env={"MY_SECRET": "hunter2", "PATH": "/bin", "PYTHONPATH": "/x"})
    settings = json.loads(env[SETTINGS_ENV])
    assert settings == {
        "broadcast_root": str((tmp_path / "run" / "broadcasts").resolve()),
        "secret_env": "MY_SECRET",
        "served_model_name": "org/model",
        "max_request_bytes": 4096,
        "private_network": False,
        "audience": None,
        "weights_origin": None,
    }
    assert "hunter2" not in env[SETTINGS_ENV]
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["PATH"] == "/bin"
    # vLLM's processes import this checkout's prime_composer, whatever their environment holds.
    source = Path(prime_composer.__file__).resolve().parent.parent
    assert env["PYTHONPATH"].split(os.pathsep) == [str(source), "/x"]


def test_extension_hands_the_published_tensors_to_vllms_reload(tmp_path: Path, monkeypatch) -> None:
    state_dict = {
        "model.embed_tokens.weight": torch.arange(6.0).reshape(3, 2),
        "model.norm.weight": torch.ones(2),
    }
    path = publish_weights(state_dict, {"tie_word_embeddings": False}, tmp_path, step=4)
    refreshed: list[object] = []
    monkeypatch.setattr(extension, "_refresh_tied_embedding_kernels", refreshed.append)

    class FakeWorker(extension.WeightUpdateExtension):
        def __init__(self) -> None:
            self.calls: list[dict] = []
            self.model_runner = type("Runner", (), {"get_model": lambda _self: "the-model"})()

        def reload_weights(self, weights_iterator=None, is_checkpoint_format=True) -> None:
            loaded = None if weights_iterator is None else dict(weights_iterator)
            self.calls.append({"weights": loaded, "checkpoint_format": is_checkpoint_format})

    worker = FakeWorker()
    assert worker.prime_composer_load_weights(str(path)) == {"num_tensors": 2}
    (call,) = worker.calls
    assert call["checkpoint_format"] is True
    assert call["weights"].keys() == state_dict.keys()
    for key, tensor in state_dict.items():
        assert torch.equal(call["weights"][key], tensor)
    worker.prime_composer_reload_base_weights()
    assert worker.calls[-1]["weights"] is None
    assert refreshed == ["the-model", "the-model"]
    # An incomplete step (no STABLE marker) is refused before vLLM's reload is called.
    (path / "STABLE").unlink()
    refused = worker.prime_composer_load_weights(str(path))
    assert "STABLE" in refused["refused"] and len(worker.calls) == 2


# --- serve_vllm against a fake vLLM ------------------------------------------------------------

FAKE_VLLM = textwrap.dedent(
    """
    import http.server, json, os, subprocess, sys
    argv = sys.argv[1:]
    port = int(argv[argv.index("--port") + 1])
    if os.environ.get("FAKE_EXIT"):
        sys.exit(int(os.environ["FAKE_EXIT"]))
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.environ["FAKE_PIDS"], "w") as f:
        json.dump({"server": os.getpid(), "grandchild": grandchild.pid, "pgid": os.getpgid(0),
                   "settings": json.loads(os.environ["PRIME_COMPOSER_VLLM_ADMIN"])}, f)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"status": "ok"}')
        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)


def _start_serve(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    python.chmod(0o755)
    pids = tmp_path / "pids.json"
    config = _config(
        tmp_path,
        port=free_port(),
        model={"name": str(tmp_path)},
        vllm={"python": str(python), "env": {"FAKE_PIDS": str(pids), **env}, "startup_timeout_s": 60},
    )
    code = (
        "import sys; from prime_composer.config.inference import InferenceConfig; "
        "from prime_composer.inference.vllm import serve_vllm; "
        "serve_vllm(InferenceConfig.model_validate_json(sys.argv[1]))"
    )
    with open(tmp_path / "serve.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, config.model_dump_json()],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc, pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_sigterm_stops_the_whole_vllm_process_group(tmp_path: Path) -> None:
    proc, pids = _start_serve(tmp_path, {})
    try:
        deadline = time.monotonic() + 60
        log = tmp_path / "serve.log"
        while not pids.exists() or not pids.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the fake vLLM never started"
            time.sleep(0.1)
        time.sleep(0.3)
        info = json.loads(pids.read_text())
        assert info["pgid"] == info["server"] != os.getpgid(proc.pid)  # its own process group
        assert info["settings"]["broadcast_root"] == str((tmp_path / "run" / "broadcasts").resolve())
        # Wait until serve_vllm has seen /health, then stop it like a launcher does.
        while "vLLM ready" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
        time.sleep(0.2)
        assert not _alive(info["server"]) and not _alive(info["grandchild"])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if pids.exists() and pids.read_text():
            for pid in json.loads(pids.read_text()).values():
                if isinstance(pid, int) and _alive(pid):
                    os.kill(pid, signal.SIGKILL)


def test_vllm_exiting_on_its_own_is_an_error(tmp_path: Path) -> None:
    proc, _ = _start_serve(tmp_path, {"FAKE_EXIT": "3"})
    assert proc.wait(timeout=60) != 0
    assert "vLLM exited with code 3" in (tmp_path / "serve.log").read_text()


def test_launch_enables_lora_with_the_trainers_rank() -> None:
    command = build_vllm_command(InferenceConfig(backend="vllm", vllm=VLLMConfig(max_lora_rank=16)), "/m")
    i = command.index("--enable-lora")
    assert command[i : i + 5] == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "1"]
    assert "--enable-lora" not in build_vllm_command(InferenceConfig(backend="vllm"), "/m")
    # vLLM accepts only some maximum ranks: the smallest that covers the adapter's
    command = build_vllm_command(InferenceConfig(backend="vllm", vllm=VLLMConfig(max_lora_rank=4)), "/m")
    assert command[command.index("--max-lora-rank") + 1] == "8"
    with pytest.raises(ValueError, match="up to rank 512"):
        build_vllm_command(InferenceConfig(backend="vllm", vllm=VLLMConfig(max_lora_rank=600)), "/m")
    with pytest.raises(ValueError, match=r"trainer\.model\.lora\.rank"):
        check_extra_args(["--max-lora-rank=8"])

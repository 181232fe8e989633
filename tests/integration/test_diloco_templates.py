"""The shipped launch templates of one DiLoCo DC (``infra/diloco/``) pass ``rl --dry-run`` with the
recipe config: the Kubernetes StatefulSet's command and environment, the SLURM job (its ``srun``
replaced by a pass-through), and ``CONFIG=configs/composer.toml launch_dc.sh --dry-run``. ``uv run``
is replaced by this interpreter, so the test needs no network and runs what ``uv run`` would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra" / "diloco"
SECRETS = {"DILOCO_SECRET": "a test secret", "OPENAI_API_KEY": "a test key"}


def _shims(tmp_path: Path) -> dict[str, str]:
    """``uv run rl ...`` -> this interpreter's ``rl``; ``srun [options] cmd`` -> ``cmd``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "uv").write_text(
        f'#!/bin/sh\n[ "$1" = run ] && shift\n[ "$1" = rl ] && shift\n'
        f'exec "{sys.executable}" -m prime_composer.launch.rl "$@"\n'
    )
    (bin_dir / "srun").write_text('#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"\n')
    for shim in bin_dir.iterdir():
        shim.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def _dry_run(command: list[str], env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in SECRETS}
    full = base | _shims(tmp_path) | {"OUTPUT_DIR": str(tmp_path / "out")} | env
    return subprocess.run(
        [*command, "--dry-run"], cwd=REPO, env=full, capture_output=True, text=True, timeout=300
    )


def _k8s_container() -> dict:
    docs = list(yaml.safe_load_all((INFRA / "k8s.yaml").read_text()))
    (stateful,) = [d for d in docs if d["kind"] == "StatefulSet"]
    (container,) = stateful["spec"]["template"]["spec"]["containers"]
    return container


def test_the_k8s_statefulset_passes_the_dry_run(tmp_path: Path) -> None:
    container = _k8s_container()
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    from_secrets = {e["name"] for e in container["env"] if "valueFrom" in e}
    assert from_secrets == set(SECRETS)  # secrets come from Secrets, never from the manifest
    assert env["CONFIG"] == "configs/composer.toml"
    env.pop("OUTPUT_DIR")  # /data is the pod's volume; here the test's directory
    result = _dry_run(container["command"], env | SECRETS, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert '"cluster_id": "dc-eu"' in result.stdout
    # Without its secret the same pod stops before anything starts.
    missing = _dry_run(container["command"], env | {"OPENAI_API_KEY": "k", "DILOCO_SECRET": ""}, tmp_path)
    assert missing.returncode != 0 and "DILOCO_SECRET" in missing.stderr


@pytest.mark.slow
def test_the_slurm_job_and_launch_dc_pass_the_dry_run(tmp_path: Path) -> None:
    fingerprint = "sha256:" + "ab" * 32
    peers = f"dc-eu=https://198.51.100.10:7701@{fingerprint}"
    dc = {"DC_ID": "dc-us", "DC_PEERS": peers, "DC_TLS_DIR": "/etc/tls"} | SECRETS
    slurm = _dry_run(["bash", str(INFRA / "slurm.sbatch")], dc | {"HOME": str(tmp_path)}, tmp_path)
    assert slurm.returncode == 0, slurm.stderr[-3000:]
    assert '"cluster_id": "dc-us"' in slurm.stdout
    direct = _dry_run(
        ["bash", str(INFRA / "launch_dc.sh")], dc | {"CONFIG": "configs/composer.toml"}, tmp_path
    )
    assert direct.returncode == 0, direct.stderr[-3000:]
    assert '"num_ranks": 6' in direct.stdout  # a sharded trainer in a DiLoCo DC
    assert fingerprint in direct.stdout and '"/etc/tls/cert.pem"' in direct.stdout
    # Plain http:// to another machine is refused unless the link is declared private.
    plain = dc | {"DC_PEERS": "dc-eu=http://198.51.100.10:7701", "DC_TLS_DIR": ""}
    refused = _dry_run(["bash", str(INFRA / "launch_dc.sh")], plain, tmp_path)
    assert refused.returncode != 0 and "private_network" in refused.stderr, refused.stderr[-2000:]
    private = _dry_run(
        ["bash", str(INFRA / "launch_dc.sh")], plain | {"DILOCO_PRIVATE_NETWORK": "1"}, tmp_path
    )
    assert private.returncode == 0, private.stderr[-3000:]

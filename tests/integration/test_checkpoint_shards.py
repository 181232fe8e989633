"""A 2-rank FSDP2 checkpoint (gloo, CPU): each rank hashed its own files and rank 0 wrote the
manifest from their digests, which must list every file with its true SHA-256 (recomputed here
with hashlib); a byte flipped in rank 1's shard makes the load fail on both ranks, naming it."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("checkpoint_shards_worker.py")


def test_each_rank_hashes_and_verifies_its_own_shards(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    result = subprocess.run(
        [*cmd, str(WORKER), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    part = tmp_path / "checkpoints" / "step_1" / "trainer"
    manifest = json.loads((part / "MANIFEST.json").read_text())["files"]
    on_disk = sorted(p.relative_to(part).as_posix() for p in part.rglob("*") if p.is_file())
    assert sorted(manifest) == [n for n in on_disk if n != "MANIFEST.json"]
    assert {"rng/rank_0.pt", "rng/rank_1.pt", "model_optim/.metadata"} <= set(manifest)
    (shard,) = [n for n in manifest if n.startswith("model_optim/__1_")]
    for name, entry in manifest.items():
        if name == shard:  # flipped after the save
            continue
        data = (part / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    for rank in (0, 1):
        error = json.loads((tmp_path / f"rank_{rank}.json").read_text())["error"]
        assert error is not None and shard in error and "corrupted" in error, (rank, error)

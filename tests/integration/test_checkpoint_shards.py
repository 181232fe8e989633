"""A 2-rank FSDP2 checkpoint (gloo, CPU): each rank hashed its own files and rank 0 wrote the
manifest from their digests, which must list every file with its true SHA-256 (recomputed here
with hashlib); a byte flipped in rank 1's shard makes the load fail on both ranks, naming it.
The worker (``checkpoint_shards_worker.py``) runs in the ``torchrun`` shared by the 2-rank tests
(``two_rank_workers.py``)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_each_rank_hashes_and_verifies_its_own_shards(two_rank_runs: Callable[[str], Path]) -> None:
    out = two_rank_runs("checkpoint_shards")  # checkpoint_shards_worker.main, in two_rank_workers.py
    part = out / "checkpoints" / "step_1" / "trainer"
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
        error = json.loads((out / f"rank_{rank}.json").read_text())["error"]
        assert error is not None and shard in error and "corrupted" in error, (rank, error)

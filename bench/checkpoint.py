"""Time of a trainer checkpoint on N FSDP2 ranks (gloo, CPU): the digest phase (every file's
SHA-256 for ``MANIFEST.json``) and the manifest check at load, with each rank hashing and
verifying its own shards (``trainer/checkpoint.py``) against rank 0 hashing every file of the
save and every rank verifying every file at load (the way before), alternated in the same run on
the same checkpoint.

    uv run python bench/checkpoint.py --ranks 4 --width 1024 --depth 8 --repeats 3

The model is ``depth`` square ``Linear`` layers (each one FSDP2 unit) after one AdamW step, so a
checkpoint holds 3 float32 copies of the parameters. Last line:
``digest_speedup=X verify_speedup=Y`` (old time / new time; ideally near the number of ranks when
the machine has a free core per rank).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker(args: argparse.Namespace) -> None:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from prime_composer.integrity import verify_manifest, write_manifest
    from prime_composer.trainer import checkpoint
    from prime_composer.trainer.model import init_distributed

    torch.set_num_threads(1)
    world = init_distributed()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.depth)])
    mesh = init_device_mesh("cpu", (world.world_size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, args.width)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    root = Path(args.root)
    manager = checkpoint.CheckpointManager(root, keep=1, world=world)
    manager.save(1, model, optimizer, scheduler)
    part = root / "step_1" / "trainer"

    def timed(fn) -> float:  # the slowest rank's time, as the run waits for it
        world.barrier()
        t0 = time.perf_counter()
        fn()
        world.barrier()
        return time.perf_counter() - t0

    def old_digest() -> None:
        if world.is_main:
            write_manifest(part)

    results: dict[str, list[float]] = {
        k: [] for k in ("digest_old", "digest_new", "verify_old", "verify_new")
    }
    for _ in range(args.repeats):
        results["digest_old"].append(timed(old_digest))
        results["digest_new"].append(timed(lambda: checkpoint.write_sharded_manifest(part, world)))
        results["verify_old"].append(timed(lambda: verify_manifest(part)))
        results["verify_new"].append(timed(lambda: checkpoint.verify_sharded_manifest(part, world)))
    size = sum(p.stat().st_size for p in part.rglob("*") if p.is_file())
    sharded = checkpoint.write_sharded_manifest

    def rank0_hashes_all(directory: Path, world_: object) -> None:
        if world.is_main:
            write_manifest(directory)

    def save(step: int) -> None:
        manager.save(step, model, optimizer, scheduler)

    for i in range(args.repeats):  # whole saves, the two ways alternated
        checkpoint.write_sharded_manifest = rank0_hashes_all  # type: ignore[assignment]
        results.setdefault("save_old", []).append(timed(functools.partial(save, 2 + 2 * i)))
        checkpoint.write_sharded_manifest = sharded
        results.setdefault("save_new", []).append(timed(functools.partial(save, 3 + 2 * i)))
    if world.is_main:
        median = {k: statistics.median(v) for k, v in results.items()}
        print(f"ranks={world.world_size} checkpoint={size / 2**20:.0f} MiB, median of {args.repeats}")
        print("| phase | rank 0 hashes all / every rank verifies all | each rank its own |")
        print("| --- | --- | --- |")
        print(f"| whole save | {median['save_old']:.3f} s | {median['save_new']:.3f} s |")
        print(f"| digests at save | {median['digest_old']:.3f} s | {median['digest_new']:.3f} s |")
        print(f"| manifest check at load | {median['verify_old']:.3f} s | {median['verify_new']:.3f} s |")
        print(
            f"digest_speedup={median['digest_old'] / median['digest_new']:.2f} "
            f"verify_speedup={median['verify_old'] / median['verify_new']:.2f}",
            flush=True,
        )
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as root:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks),
            __file__, "--worker", "--root", root, "--width", str(args.width), "--depth", str(args.depth),
            "--repeats", str(args.repeats),
        ]  # fmt: skip
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


if __name__ == "__main__":
    main()

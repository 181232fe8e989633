"""A DC worker with a plain-torch inner loop, for the multi-DC tests, the benchmark and the
network-namespace harness (``infra/diloco/netsim.py``).

Each DC trains an MLP (``--width``, ``--depth``) with AdamW on its own stream of a shared
regression task (the seed differs per DC, the target function does not), runs the outer loop
after every step, and appends one JSON line per applied round to ``--out``: the round, fragment,
members, committer and the SHA-256 of the new global fragment, so a test can check that every
DC ended each round with the same bits. At the end it writes ``{"done": ...}`` with timings and
saves the global weights as ``<work-dir>/theta.pt``, and keeps its origin up until ``--stop-file`` exists (which also ends training early) (peers may still be fetching from it).

    python -m prime_composer.diloco.toy --config dc-a.json --steps 40 --out dc-a.jsonl

Under ``torchrun --nproc-per-node N`` (``spawn(..., ranks=N)``) the DC is N ranks (gloo): the MLP
is sharded with FSDP2 (each ``Linear``, then the root), every rank draws the same batch and
trains on its ``1/N`` of the rows (so the averaged gradient is the full batch's, as with one
rank), and rank 0 writes the log. ``<work-dir>/local.pt`` is the DC's model at the end (gathered).
``--replicate R`` makes the DC HSDP instead, as the trainer's ``trainer.parallel.replicate``: the
same ``fully_shard`` calls on a ``(R, N / R)`` mesh; ``done`` then says whether the R copies hold
the same shards (``replicas_agree``).

``--die-at-round R`` kills the process (SIGKILL) right after it published round R's payload
(mid-round: before any commit); ``--die-at-step N`` after inner step N (any backend);
``--step-sleep-s`` stands in for a slower trainer (not counted as compute); ``--compute-s`` pads
every step to that many seconds of compute (sleeping, as a GPU step leaves the CPU free), so
utilisation is measured against a known compute time. ``done`` reports ``compute_s`` and
``wall_s`` from the first step on.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from prime_composer.config.diloco import DilocoConfig, PeerConfig
from prime_composer.config.ports import free_port
from prime_composer.diloco.base import build_outer_loop
from prime_composer.diloco.loop import ShardcastOuterLoop
from prime_composer.diloco.payload import tensor_digest
from prime_composer.diloco.torchft_backend import TorchftOuterLoop


def make_model(width: int, depth: int, seed: int = 0) -> nn.Module:
    """The same initial weights in every DC (seed 0), as DiLoCo requires."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def loopback_configs(num_dcs: int, secret_env: str, **fields: Any) -> list[DilocoConfig]:
    """Configs of ``num_dcs`` DCs (``dc-0``, ``dc-1``, ...) that reach each other on 127.0.0.1."""
    ports = [free_port() for _ in range(num_dcs)]
    return [
        DilocoConfig(
            enabled=True,
            cluster_id=f"dc-{i}",
            port=ports[i],
            peers=[
                PeerConfig(cluster_id=f"dc-{j}", urls=[f"http://127.0.0.1:{ports[j]}"])
                for j in range(num_dcs)
                if j != i
            ],
            secret_env=secret_env,
            **fields,
        )
        for i in range(num_dcs)
    ]


def spawn(
    cfg: DilocoConfig,
    root: Path,
    *args: str,
    env: dict[str, str] | None = None,
    prefix: list[str] | None = None,
    ranks: int = 1,
) -> subprocess.Popen[bytes]:
    """Start a toy DC for ``cfg`` under ``root/<cluster_id>/`` (its log is ``<cluster_id>.jsonl``).

    ``prefix`` runs it under another command (``ip netns exec ns``); ``ranks`` > 1 under
    ``torchrun`` (a sharded DC, in its own process group: kill it with ``os.killpg``)."""
    work = root / cfg.cluster_id
    work.mkdir(parents=True, exist_ok=True)
    config = work / "config.json"
    config.write_text(cfg.model_dump_json())
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] if ranks > 1 else []
    )
    command = [
        *(prefix or []),
        sys.executable,
        *launcher,
        "-m",
        "prime_composer.diloco.toy",
        "--config",
        str(config),
        "--work-dir",
        str(work),
        "--out",
        str(root / f"{cfg.cluster_id}.jsonl"),
        "--stop-file",
        str(root / "STOP"),
        *args,
    ]
    stderr = open(work / "stderr.log", "ab")  # noqa: SIM115 - the child owns it
    env = {**os.environ, **(env or {})} | ({"OMP_NUM_THREADS": "1"} if ranks > 1 else {})
    return subprocess.Popen(command, env=env, stdout=stderr, stderr=stderr, start_new_session=ranks > 1)


def read_log(path: Path) -> list[dict[str, Any]]:
    """The JSON lines a toy DC wrote (none if it has not started)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _replicas_agree(model: nn.Module, mesh: Any) -> bool:
    """Whether every copy of an HSDP model holds the same shards: each rank's local shards are
    compared with those of the ranks in the other copies at its place (collective)."""
    import hashlib

    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.to_local().detach().numpy().tobytes())  # type: ignore[attr-defined]
    digests: list[Any] = [None] * mesh.size(0)
    torch.distributed.all_gather_object(digests, h.hexdigest(), group=mesh.get_group("replicate"))
    verdicts: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(verdicts, len(set(digests)) == 1)
    return all(verdicts)


def _die_after_publishing(store: Any, round_: int) -> None:
    """SIGKILL this process right after its grad payload of ``round_`` is served: mid-round."""
    publish = store.publish

    def publish_then_die(kind: str, r: int, data: bytes) -> None:
        publish(kind, r, data)
        if kind == "grad" and r == round_:
            os.kill(os.getpid(), signal.SIGKILL)

    store.publish = publish_then_die


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, required=True, help="DilocoConfig as JSON")
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=40, help="inner updates to reach")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1, help="data seed of this DC")
    parser.add_argument("--replicate", type=int, default=1, help="HSDP copies (ranks / shards)")
    parser.add_argument("--die-at-round", type=int, default=None)
    parser.add_argument("--die-at-step", type=int, default=None, help="SIGKILL after this inner step")
    parser.add_argument("--step-sleep-s", type=float, default=0.0)
    parser.add_argument("--compute-s", type=float, default=0.0)
    parser.add_argument("--stop-file", type=Path, default=None)
    parser.add_argument("--start-file", type=Path, default=None, help="wait for it before the first step")
    args = parser.parse_args(argv)

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size % args.replicate or (args.replicate > 1 and world_size == 1):
        parser.error(
            f"--replicate {args.replicate} must divide the {world_size} ranks (and be 1 for one rank)"
        )
    torch.set_num_threads(1)
    cfg = DilocoConfig.model_validate_json(args.config.read_text())
    model = make_model(args.width, args.depth)
    rank = 0
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.distributed.init_process_group("gloo")
        rank = torch.distributed.get_rank()
        if args.replicate > 1:  # HSDP, as the trainer's device_mesh builds it
            shape = (args.replicate, world_size // args.replicate)
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (world_size,))
        for layer in model.modules():
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    leader = rank == 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(args.seed)
    target = torch.Generator().manual_seed(1234)
    w_true = torch.randn(args.width, 1, generator=target)

    t_start = time.monotonic()
    outer = build_outer_loop(cfg, model, optimizer, args.work_dir)
    # The logs are per backend: shardcast's rounds carry members and committer, torchft's do not.
    shardcast = outer if isinstance(outer, ShardcastOuterLoop) else None
    torchft = outer if isinstance(outer, TorchftOuterLoop) else None
    if args.die_at_round is not None and shardcast is not None and shardcast.store is not None:
        _die_after_publishing(shardcast.store, args.die_at_round)
    compute_s = 0.0

    def should_stop() -> bool:  # the leader's view, so every rank stops at the same step
        stop = args.stop_file is not None and args.stop_file.exists()
        if world_size == 1:
            return stop
        box = [stop]
        torch.distributed.broadcast_object_list(box, src=0)
        return bool(box[0])

    with open(args.out if leader else os.devnull, "a") as log:
        start = step = shardcast.num_updates if shardcast is not None else 0
        log.write(json.dumps({"start": True, "num_updates": start, "pid": os.getpid()}) + "\n")
        log.flush()
        while args.start_file is not None and not args.start_file.exists():
            time.sleep(0.05)
        t_first = time.monotonic()

        def num_updates() -> int:
            # torchft: the manager's step (a healed DC takes its peer's), in inner updates.
            if torchft is not None:
                return torchft.manager.current_step() * cfg.steps_per_fragment
            assert shardcast is not None
            return shardcast.num_updates

        while num_updates() < args.steps and not should_stop():
            t0 = time.monotonic()
            x = torch.randn(args.batch, args.width, generator=generator).chunk(world_size)[rank]
            loss = (model(x) - torch.tanh(x @ w_true)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if args.compute_s:  # a fixed step time, as a GPU step that leaves the CPU free
                time.sleep(max(0.0, args.compute_s - (time.monotonic() - t0)))
            compute_s += time.monotonic() - t0
            if args.step_sleep_s:
                time.sleep(args.step_sleep_s)
            before = shardcast.last_result if shardcast is not None else None
            changed = outer.after_inner_step(step, args.batch, skipped=False)
            step += 1
            if torchft is not None and changed:
                # torchft syncs fragment k % P at its k-th outer step; alpha 0: local == global.
                record = {
                    "round": torchft.manager.current_step() - 1,
                    "digest": torchft.global_digest(),
                    "members": torchft.manager.num_participants(),
                    "t": round(time.monotonic() - t_start, 3),
                }
                log.write(json.dumps(record) + "\n")
                log.flush()
            if args.die_at_step is not None and step == args.die_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
            result = shardcast.last_result if shardcast is not None else None
            if shardcast is not None and result is not None and result is not before:
                f = result.fragment
                record = {
                    "round": result.round,
                    "fragment": f,
                    "members": result.members,
                    "committer": result.committer,
                    "digest": tensor_digest(shardcast.theta[f]),
                    "loss": float(loss.detach()),
                    "t": round(time.monotonic() - t_start, 3),
                    "round_s": outer.last_metrics.get("diloco/round_s"),
                }
                log.write(json.dumps(record) + "\n")
                log.flush()
        wall_s = time.monotonic() - t_first
        done = {
            "done": True,
            "wall_s": wall_s,
            "compute_s": compute_s,
            "num_updates": num_updates(),
            "global_digest": outer.global_digest(),
            "rejected": dict(shardcast.exchange.rejected) if shardcast is not None else {},
        }
        if args.replicate > 1:
            done["replicas_agree"] = _replicas_agree(model, mesh)
        theta = shardcast.theta if shardcast is not None else torchft.theta if torchft is not None else []
        local = [f.gather(leader) for f in shardcast.fragments] if shardcast is not None else []
        if leader:
            torch.save(torch.cat(theta), args.work_dir / "theta.pt")
            if shardcast is not None:
                torch.save(torch.cat([t for t in local if t is not None]), args.work_dir / "local.pt")
        log.write(json.dumps(done) + "\n")
        log.flush()
    while args.stop_file is not None and not args.stop_file.exists():
        time.sleep(0.1)
    outer.close()


if __name__ == "__main__":
    main()

"""HSDP (``trainer.parallel.replicate = 2``: 2 copies x 2 shards) on 4 gloo CPU ranks trains like
FSDP2 over the 4 ranks and like one unsharded process, and resumes exactly.

The runs are the real ``Trainer`` (``hsdp_worker.py``, one ``torchrun`` of 4 ranks for all of them)
on batches a stand-in orchestrator packed for 4 ranks. The reference is computed here, in one
process with no process group and no sharding: the same ``Trainer`` stepping over every rank's
micro-batches. What must agree:

- the losses (1e-6) and the gradient norms before clipping (relative 1e-5) of 3 steps, FSDP and
  HSDP against the reference (the norm is all-reduced over the 2-D mesh by the DTensors, the loss normalizers over all
  ranks by the flat group);
- the weights each run published after its last step against the reference's (1e-5): the
  gradients FSDP2 reduce-scatters within a copy and all-reduces across copies are the sum the
  global normalizers expect;
- an HSDP run resumed from its own checkpoint of step 2: the same loss and bitwise the same
  weights as the uninterrupted HSDP run; one resumed from the FSDP run's checkpoint (DCP reshards
  4 shards into 2 x 2): the same within rounding (1e-6 loss, 1e-5 weights).

The mesh of each run is checked too (``layout.json``), so an HSDP setting that were silently
ignored would fail here.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prime_composer.config.transport import TransportConfig
from prime_composer.metrics import read_metrics
from prime_composer.orchestrator.packing import pack_step
from prime_composer.orchestrator.sample import Sample
from prime_composer.transport.filesystem import FilesystemSender
from prime_composer.transport.weights import load_weights, step_path

WORKER = Path(__file__).with_name("hsdp_worker.py")
sys.path.insert(0, str(WORKER.parent))
from hsdp_worker import MAX_STEPS, NUM_RANKS, trainer_config  # noqa: E402

RUNS = ("fsdp", "hsdp", "hsdp_resumed", "hsdp_from_fsdp")


def _samples(step: int) -> list[Sample]:
    rng = random.Random(100 + step)
    out = []
    for i in range(8):
        prompt = [rng.randint(3, 400) for _ in range(rng.randint(3, 6))]
        completion = [rng.randint(3, 400) for _ in range(rng.randint(3, 8))]
        out.append(
            Sample(
                prompt_ids=prompt,
                completion_ids=completion,
                completion_logprobs=[-rng.uniform(0.5, 6.0) for _ in completion],
                completion_mask=[1] * len(completion),
                reward=float(i % 2),
                example_id=i // 2,
                group_id=i // 2,
                policy_step=step,
                advantage=rng.uniform(-1, 1),
            )
        )
    return out


def _batches(step: int) -> list:
    return pack_step(_samples(step), 32, 1, NUM_RANKS, pad_token_id=0)[0]


def _reference(output_dir: Path) -> tuple[dict[int, dict], dict[str, torch.Tensor]]:
    """Losses, grad norms and final weights of one process on every rank's micro-batches."""
    from prime_composer.trainer.model import World, full_state_dict
    from prime_composer.trainer.train import Trainer

    torch.set_num_threads(1)
    config = trainer_config(output_dir, replicate=1).model_copy(update={"num_ranks": 1})
    trainer = Trainer(config, World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    metrics = {}
    for step in range(MAX_STEPS):
        metrics[step] = trainer.step([mb for rank in _batches(step) for mb in rank], step)
    return metrics, full_state_dict(trainer.model)


def _metrics(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run / "metrics" / "trainer.jsonl")}


@pytest.mark.slow
def test_hsdp_two_by_two_trains_like_fsdp_and_one_process_and_resumes(tmp_path: Path) -> None:
    for name in RUNS:
        sender = FilesystemSender(tmp_path / name, TransportConfig(keep_last_steps=MAX_STEPS + 1))
        for step in range(MAX_STEPS):
            sender.send(step, _batches(step))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NUM_RANKS)]
    result = subprocess.run(
        [*cmd, str(WORKER), str(tmp_path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    layouts = {name: json.loads((tmp_path / name / "layout.json").read_text()) for name in RUNS}
    rows = layouts["fsdp"]["full_rows"]
    assert layouts["fsdp"]["mesh"] == [4] and layouts["fsdp"]["local_rows"] == -(-rows // 4)
    for name in RUNS[1:]:
        assert layouts[name]["mesh"] == [2, 2], layouts[name]
        assert layouts[name]["placements"] == ["R", "S(0)"], layouts[name]
        assert layouts[name]["local_rows"] == -(-rows // 2), layouts[name]

    reference, weights = _reference(tmp_path / "reference")
    assert all(m["grad_norm"] > 0.2 for m in reference.values())  # every step clipped
    assert len({round(m["loss/total"], 6) for m in reference.values()}) == MAX_STEPS
    for name in ("fsdp", "hsdp"):
        got = _metrics(tmp_path / name)
        assert sorted(got) == list(range(MAX_STEPS)), name
        for step, ref in reference.items():
            assert abs(got[step]["loss/total"] - ref["loss/total"]) <= 1e-6, (name, step, got[step], ref)
            assert abs(got[step]["grad_norm"] - ref["grad_norm"]) <= 1e-5 * ref["grad_norm"], (name, step)
            assert got[step]["perf/num_tokens"] == ref["perf/num_tokens"], (name, step)
        published = load_weights(step_path(tmp_path / name / "broadcasts", MAX_STEPS))
        assert published and published.keys() <= weights.keys()  # a tied head is published once
        for key, w in published.items():
            torch.testing.assert_close(w, weights[key], rtol=0, atol=1e-5, msg=f"{name} {key}")

    straight = _metrics(tmp_path / "hsdp")
    final = load_weights(step_path(tmp_path / "hsdp" / "broadcasts", MAX_STEPS))
    for name, exact in (("hsdp_resumed", True), ("hsdp_from_fsdp", False)):
        resumed = _metrics(tmp_path / name)
        assert sorted(resumed) == [2], (name, resumed)
        got = load_weights(step_path(tmp_path / name / "broadcasts", MAX_STEPS))
        if exact:  # its own checkpoint, the same layout: bitwise
            assert resumed[2]["loss/total"] == straight[2]["loss/total"], name
            for key, w in final.items():
                assert torch.equal(got[key], w), (name, key)
        else:  # the FSDP run's state of step 2, itself within rounding of HSDP's
            assert abs(resumed[2]["loss/total"] - straight[2]["loss/total"]) <= 1e-6, name
            for key, w in final.items():
                torch.testing.assert_close(got[key], w, rtol=0, atol=1e-5, msg=f"{name} {key}")

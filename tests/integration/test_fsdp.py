"""FSDP2 on 2 CPU ranks (gloo, torchrun) against one unsharded process on the same global batch.

The reference here shares no sharding code: transformers' own loss per sample (mean over
labels, times the count), one plain backward, ``torch.nn.utils.clip_grad_norm_``. The workers
(``fsdp_worker.py``, in the ``torchrun`` shared by the 2-rank tests: ``two_rank_workers.py``) shard per decoder layer + root, split the batch over ranks and micro-batches
and normalise by the global token count. Gradients, the clipped norm and the updated weights
must agree within 1e-5; the gathered full state dict, the exported HF directory and the 2-rank
DCP checkpoint (loaded into 1 process, so resharded) must all hold those same weights.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from prime_composer.config.base import ModelConfig
from prime_composer.trainer.checkpoint import CheckpointManager, latest_complete_step
from prime_composer.trainer.model import World, load_model
from prime_composer.trainer.optim import build_optimizer
from prime_composer.trainer.sft_data import load_sft_samples

sys.path.insert(0, str(Path(__file__).parent))
from fsdp_worker import MODEL, OPTIM

pytestmark = pytest.mark.slow  # more than ~30 s on 2 cores: left out of the fast lane


def _reference(data: Path) -> tuple[dict, torch.Tensor, dict]:
    torch.set_num_threads(1)
    model, tokenizer = load_model(MODEL, torch.device("cpu"))
    optimizer, _ = build_optimizer(model, OPTIM, max_steps=1)
    samples = load_sft_samples(data, tokenizer, seq_len=64)
    num_loss_tokens = sum(s.num_loss_tokens for s in samples)
    total = torch.zeros(())
    for s in samples:
        ids = torch.tensor([s.input_ids])
        labels = torch.where(torch.tensor([s.loss_mask]), ids, torch.full_like(ids, -100))
        total = total + model(input_ids=ids, labels=labels).loss * sum(s.loss_mask)
    (total / num_loss_tokens).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.max_grad_norm)
    optimizer.step()
    return grads, norm, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_fsdp2_two_ranks_match_one_process(two_rank_runs: Callable[[str], Path]) -> None:
    out = two_rank_runs("fsdp")  # fsdp_worker.main on fsdp_worker.write_data's samples
    data = out / "data.jsonl"
    sharded = torch.load(out / "rank0.pt", weights_only=True)
    grads, norm, weights = _reference(data)

    assert grads.keys() == sharded["grads"].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(sharded["grads"][name], grad, rtol=0, atol=1e-5, msg=name)
    torch.testing.assert_close(sharded["norm"], norm, rtol=1e-5, atol=0)
    assert norm > OPTIM.max_grad_norm  # clipping really happened on both sides
    assert weights.keys() == sharded["weights"].keys()
    for name, w in weights.items():
        torch.testing.assert_close(sharded["weights"][name], w, rtol=0, atol=1e-5, msg=name)

    # The exported HF directory holds exactly the gathered weights.
    exported, _ = load_model(ModelConfig(name=str(out / "final")), torch.device("cpu"))
    for name, w in exported.state_dict().items():
        assert torch.equal(w, sharded["weights"][name]), name

    # The 2-rank checkpoint loads into one unsharded process (DCP reshards by name).
    assert latest_complete_step(out / "checkpoints") == 1
    model, _ = load_model(MODEL, torch.device("cpu"))
    optimizer, scheduler = build_optimizer(model, OPTIM, max_steps=1)
    world = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    CheckpointManager(out / "checkpoints", keep=1, world=world).load(None, model, optimizer, scheduler)
    for name, w in model.state_dict().items():
        assert torch.equal(w, sharded["weights"][name]), name
    assert scheduler.last_epoch == 1
    assert all(int(s["step"]) == 1 for s in optimizer.state_dict()["state"].values())

"""The RL trainer step on 2 FSDP2 ranks (gloo) equals the same step in one unsharded process.

All terms are on (RL + KL reference + SDPO with an EMA teacher), so this covers the lean chunked
head under FSDP (its weight gradient reaches the root's reduce-scatter), the sharded policy copies,
the global normalizers and the dummy teacher forward of a rank without hints. Gradients are
compared with and without deferring the gradient reduce-scatter to the last micro-batch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from prime_composer.trainer.losses.base import TermContext, build_terms
from prime_composer.trainer.model import load_model
from prime_composer.trainer.step import train_step
from prime_composer.transport.groups import SDPOGroup

sys.path.insert(0, str(Path(__file__).parent))
from rl_fsdp_worker import LOSS, MODEL, packed


def _unsharded() -> tuple[dict, float, dict]:
    torch.set_num_threads(1)
    model, _ = load_model(MODEL, torch.device("cpu"))
    (micro_batches,) = packed(1)
    result = train_step(model, micro_batches, build_terms(LOSS, TermContext(model)), torch.device("cpu"))
    return {n: p.grad.clone() for n, p in model.named_parameters()}, float(result.loss), result.metrics


MODES = ("defer", "every")


@pytest.fixture(scope="module")
def runs(two_rank_runs: Callable[[str], Path]) -> dict[str, dict]:
    """Both modes' sharded steps (``rl_fsdp_worker.main``, in the ``torchrun`` shared by the 2-rank
    tests: ``two_rank_workers.py``)."""
    out = two_rank_runs("rl_fsdp")
    return {mode: torch.load(out / f"{mode}.pt", weights_only=True) for mode in MODES}


@pytest.fixture(scope="module")
def unsharded() -> tuple[dict, float, dict]:
    return _unsharded()


@pytest.mark.slow
@pytest.mark.parametrize("defer", MODES)
def test_two_ranks_match_one_process(
    runs: dict[str, dict], unsharded: tuple[dict, float, dict], defer: str
) -> None:
    ranks = packed(2)
    # Rank 1 must hold a micro-batch without hints where rank 0 has some: the dummy teacher row.
    hinted = [[mb.group(SDPOGroup) is not None for mb in r] for r in ranks]
    assert any(a != b for a, b in zip(*hinted, strict=True)), hinted
    sharded = runs[defer]
    grads, loss, metrics = unsharded
    assert float(sharded["loss"]) == pytest.approx(loss, rel=1e-5)
    for key in ("loss/rl", "loss/sdpo", "sdpo/num_tokens", "rl/kl_ref", "rl/entropy"):
        assert sharded["metrics"][key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), key
    assert metrics["loss/sdpo"] > 0 and metrics["rl/kl_ref"] >= 0
    assert grads.keys() == sharded["grads"].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(sharded["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)

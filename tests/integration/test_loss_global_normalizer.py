"""The RL loss's global normalizer and metric reduction across two gloo ranks on loopback.

Rank 0 holds rows 0-2 in two micro-batches, rank 1 rows 3-7 in one. With the all-reduced
normalizer, the sum of the ranks' gradients (what data parallelism adds up) and the reduced metrics
must equal one process computing the loss on all 8 rows at once. The checks run on the ranks
(``check_on_two_ranks``, a part of the ``torchrun`` shared by the 2-rank tests:
``two_rank_workers.py``); an assertion that fails there fails this test with its traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from prime_composer.config.loss import RLLossConfig
from prime_composer.trainer.losses.aggregate import accumulate_metrics, finalize_metrics, rl_normalizer
from prime_composer.trainer.losses.rl import rl_loss

pytestmark = pytest.mark.slow  # more than ~30 s on 2 cores: left out of the fast lane


def _step_data() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    batch, seq_len = 8, 6
    logprobs = -2.0 * torch.rand(batch, seq_len, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, seq_len, (batch, 1), generator=gen)
    return {
        "logprobs": logprobs,
        "old": logprobs + 0.3 * torch.randn(batch, seq_len, generator=gen, dtype=torch.float64),
        "adv": torch.randn(batch, generator=gen, dtype=torch.float64),
        "mask": torch.arange(seq_len)[None] < lengths,
    }


def check_on_two_ranks(out: Path) -> None:
    """Both aggregations on this rank's rows, against one process's loss on all rows (run in a
    2-rank gloo group)."""
    rank = dist.get_rank()
    assert dist.get_world_size() == 2
    data = _step_data()
    for aggregation in ("token_mean", "sequence_mean"):
        cfg = RLLossConfig(aggregation=aggregation)
        splits = [[slice(0, 1), slice(1, 3)], [slice(3, 8)]][rank]
        normalizer = rl_normalizer([data["mask"][rows] for rows in splits], cfg)
        expected_normalizer = float(data["mask"].sum()) if aggregation == "token_mean" else 8.0
        assert normalizer == expected_normalizer, (aggregation, normalizer)

        logprobs = data["logprobs"].clone().requires_grad_(True)
        acc: dict[str, torch.Tensor] = {}
        for rows in splits:
            loss, metrics = rl_loss(
                logprobs[rows], data["old"][rows], data["adv"][rows], data["mask"][rows], cfg, normalizer
            )
            loss.backward()
            accumulate_metrics(acc, metrics)
        grad = logprobs.grad.clone()
        dist.all_reduce(grad)
        reduced = finalize_metrics(acc)

        single = data["logprobs"].clone().requires_grad_(True)
        loss, metrics = rl_loss(single, data["old"], data["adv"], data["mask"], cfg, expected_normalizer)
        loss.backward()
        assert single.grad.abs().sum() > 0
        torch.testing.assert_close(grad, single.grad, rtol=1e-12, atol=1e-14)
        assert reduced == pytest.approx({k: float(v[0] / v[1]) for k, v in metrics.items()})
    (out / f"checked-rank{rank}").touch()


def test_two_gloo_ranks_match_one_process(two_rank_runs: Callable[[str], Path]) -> None:
    out = two_rank_runs("loss_global_normalizer")
    assert sorted(p.name for p in out.glob("checked-rank*")) == ["checked-rank0", "checked-rank1"]

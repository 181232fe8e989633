"""The RL loss's global normalizer and metric reduction across two gloo ranks on loopback.

Rank 0 holds rows 0-2 in two micro-batches, rank 1 rows 3-7 in one. With the all-reduced
normalizer, the sum of the ranks' gradients (what data parallelism adds up) and the reduced metrics
must equal one process computing the loss on all 8 rows at once.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from prime_composer.config.loss import RLLossConfig
from prime_composer.config.ports import free_port
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


def _worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
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
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_match_one_process():
    mp.spawn(_worker, args=(free_port(),), nprocs=2, join=True)

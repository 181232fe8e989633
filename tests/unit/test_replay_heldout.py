"""Held-out DPO metrics, newest-first pairs and the refreshed reference of the replay channel.

Every value is checked against an independent computation: plain unpacked forwards of each side
and the DPO formula written out, TRL's own reference sync (``SyncRefModelCallback``), and cursors
worked out by hand."""

from __future__ import annotations

import asyncio
import copy
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_replay_channel import FakeStore, load, pack, pair, side_logp

from prime_composer.config.dpo import DPOLossConfig
from prime_composer.config.loss import LossConfig
from prime_composer.config.orchestrator import ReplaySourceConfig
from prime_composer.model.resolve import resolve_model_name
from prime_composer.orchestrator.replay.packing import HeldOutPair
from prime_composer.orchestrator.replay.source import PairSource
from prime_composer.trainer.losses.base import TermContext, build_terms
from prime_composer.trainer.step import train_step
from prime_composer.transport.batch import decode_rank_batch, encode_rank_batch
from prime_composer.transport.groups import ReplayGroup


@pytest.fixture(scope="module")
def model_path() -> str:
    torch.set_num_threads(1)
    return resolve_model_name("builtin:tiny-qwen3")


def test_heldout_pairs_are_scored_with_trls_metrics_and_never_trained_on(model_path: str) -> None:
    rng = random.Random(11)
    trained = [pair(rng, c, smoothing=0.1 * c) for c in range(1, 4)]
    heldout = [pair(rng, c, smoothing=0.2) for c in range(4, 6)]
    mbs = pack([*trained, *(HeldOutPair(p) for p in heldout)], micro_batch_size=1)
    flags = [mb.group(ReplayGroup).heldout.tolist() for mb in mbs if mb.group(ReplayGroup) is not None]  # type: ignore[union-attr]
    assert sum(map(sum, flags)) == 2 and sum(map(len, flags)) == 5
    _, _, decoded = decode_rank_batch(encode_rank_batch(0, 0, mbs))  # the flag crosses the wire
    assert [g.heldout.tolist() for mb in decoded if (g := mb.group(ReplayGroup)) is not None] == flags
    beta = 0.3
    model = load(model_path)
    terms = build_terms(
        LossConfig(rl={"weight": 0.0}, replay={"weight": 1.0, "beta": beta}), TermContext(model)
    )
    result = train_step(model, mbs, terms, torch.device("cpu"))
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    reference = load(model_path)

    def margins(pairs: list) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        chosen = [
            side_logp(reference, p.context_ids, p.chosen_ids) - sum(p.ref_chosen_logprobs) for p in pairs
        ]
        rejected = [
            side_logp(reference, p.context_ids, p.rejected_ids) - sum(p.ref_rejected_logprobs) for p in pairs
        ]
        return chosen, rejected

    chosen, rejected = margins(trained)
    total = sum(
        -(1 - p.label_smoothing) * F.logsigmoid(beta * (c - r))
        - p.label_smoothing * F.logsigmoid(-beta * (c - r))
        for p, c, r in zip(trained, chosen, rejected, strict=True)
    )
    (total / len(trained)).backward()  # type: ignore[union-attr]
    assert result.metrics["loss/replay"] == pytest.approx(float(total.detach()) / 3, rel=1e-6)  # type: ignore[union-attr]
    assert result.metrics["replay/num_pairs"] == 3  # the held-out pairs are not in the normalizer
    for name, param in reference.named_parameters():  # ... nor in the gradient
        torch.testing.assert_close(got[name], param.grad, rtol=1e-5, atol=1e-7)

    with torch.no_grad():
        chosen, rejected = margins(heldout)
    h = [float(c - r) for c, r in zip(chosen, rejected, strict=True)]
    assert result.metrics["dpo_heldout/margin"] == pytest.approx(beta * sum(h) / 2, rel=1e-6)
    assert result.metrics["dpo_heldout/accuracy"] == sum(x > 0 for x in h) / 2
    assert result.metrics["dpo_heldout/chosen_reward"] == pytest.approx(
        beta * float(sum(chosen)) / 2, rel=1e-6
    )
    assert result.metrics["dpo_heldout/rejected_reward"] == pytest.approx(
        beta * float(sum(rejected)) / 2, rel=1e-6
    )
    loss = [0.8 * math.log1p(math.exp(-beta * x)) + 0.2 * math.log1p(math.exp(beta * x)) for x in h]
    assert result.metrics["dpo_heldout/loss"] == pytest.approx(sum(loss) / 2, rel=1e-6)


def test_the_source_holds_out_the_first_pairs_and_scores_them_every_k_steps(tmp_path: Path) -> None:
    """By hand: heldout_pairs = 2, heldout_every = 2, 3 pairs per step, cursors 1-10 ready. The
    held-out set is {1, 2}; steps 0, 1, 2 train on 3-5, 6-8, 9-10, and the set rides along at
    steps 0 and 2; a resumed source reads the same set again."""
    rng = random.Random(12)
    cfg = ReplaySourceConfig(enabled=True, pairs_per_step=3, heldout_pairs=2, heldout_every=2)
    store = FakeStore([pair(rng, c) for c in range(1, 11)])
    source = PairSource(cfg, tmp_path)
    source.teacher.store = store  # type: ignore[assignment]

    def split(items: list) -> tuple[list[int], list[int]]:
        return (
            [p.cursor for p in items if not isinstance(p, HeldOutPair)],
            [p.pair.cursor for p in items if isinstance(p, HeldOutPair)],
        )

    assert split(asyncio.run(source.take(0))) == ([3, 4, 5], [1, 2])
    assert source.metrics()["replay/pairs"] == 3 and source.metrics()["replay/heldout_scored"] == 2
    assert split(asyncio.run(source.take(1))) == ([6, 7, 8], [])
    resumed = PairSource(cfg, tmp_path)
    resumed.teacher.store = store  # type: ignore[assignment]
    resumed.load_state_dict(source.state_dict())
    assert split(asyncio.run(resumed.take(2))) == ([9, 10], [1, 2])
    assert split(asyncio.run(resumed.take(3))) == ([], [])


def test_newest_first_takes_the_newest_pairs_and_counts_the_skipped(tmp_path: Path) -> None:
    """By hand: 10 pairs ready at step 0, 3 per step newest first: step 0 takes 8-10 (7 skipped);
    with 11 and 12 ready at step 1, it takes both (nothing older left)."""
    rng = random.Random(13)
    source = PairSource(ReplaySourceConfig(enabled=True, pairs_per_step=3, order="newest"), tmp_path)
    store = FakeStore([pair(rng, c) for c in range(1, 11)])
    source.teacher.store = store  # type: ignore[assignment]
    assert [p.cursor for p in asyncio.run(source.take(0))] == [8, 9, 10]
    assert source.metrics()["replay/pairs_stale"] == 7
    store.pairs += [pair(rng, c) for c in (11, 12)]
    assert [p.cursor for p in asyncio.run(source.take(1))] == [11, 12]
    assert source.metrics()["replay/pairs_stale"] == 0


def _refreshed(model: torch.nn.Module, **kwargs: object) -> tuple[TermContext, list]:
    ctx = TermContext(model)
    cfg = LossConfig(
        rl={"weight": 0.0}, replay={"weight": 1.0, "beta": 0.5, "reference": "refreshed", **kwargs}
    )
    return ctx, build_terms(cfg, ctx)


def _sgd_step(model: torch.nn.Module, mbs: list, terms: list, ctx: TermContext) -> dict[str, float]:
    model.zero_grad()
    result = train_step(model, mbs, terms, torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    ctx.after_optimizer_step()
    return result.metrics


def test_a_refreshed_reference_scores_the_pairs_and_follows_trls_sync(model_path: str) -> None:
    rng = random.Random(14)
    mbs = pack([pair(rng, c, smoothing=0.0) for c in range(1, 4)])
    model = load(model_path)
    initial = copy.deepcopy(model)
    ctx, terms = _refreshed(model, ref_sync_steps=2, ref_mixup_alpha=0.6)
    (term,) = terms
    # Step 1: the reference is the policy itself, not the stored (random) sums: every margin is 0.
    first = _sgd_step(model, mbs, terms, ctx)
    assert first["loss/replay"] == pytest.approx(math.log(2), rel=1e-6)
    assert first["dpo/ref_drift"] == 0.0 and first["replay/ref_refreshes"] == 0
    for a, b in zip(term.reference.module.parameters(), initial.parameters(), strict=True):
        assert torch.equal(a, b)  # not due after one step
    _sgd_step(model, mbs, terms, ctx)
    # TRL's own sync of the initial weights toward the policy after step 2.
    from trl.trainer.callbacks import SyncRefModelCallback

    SyncRefModelCallback._sync_target_model(model, initial, 0.6)
    for a, b in zip(term.reference.module.parameters(), initial.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert term.reference.refreshes == 1
    # The checkpoint holds the moved weights and the schedule.
    state = ctx.checkpoint_states()["policy_copy_replay_reference"].state_dict()
    _, (other,) = _refreshed(load(model_path), ref_sync_steps=2, ref_mixup_alpha=0.6)
    other.reference.load_state_dict(copy.deepcopy(state))
    assert (other.reference.steps, other.reference.refreshes) == (2, 1)
    for a, b in zip(other.reference.module.parameters(), initial.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_a_refreshed_reference_moves_when_the_policy_drifts(model_path: str) -> None:
    rng = random.Random(15)
    mbs = pack([pair(rng, c, smoothing=0.0) for c in range(1, 3)])
    model = load(model_path)
    ctx, (term,) = _refreshed(model, ref_sync_steps=None, ref_max_drift=1e-6, ref_mixup_alpha=1.0)
    assert _sgd_step(model, mbs, [term], ctx)["dpo/ref_drift"] == 0.0 and term.reference.refreshes == 0
    drifted = _sgd_step(model, mbs, [term], ctx)
    assert drifted["dpo/ref_drift"] > 1e-6 and term.reference.refreshes == 1
    for a, b in zip(term.reference.module.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)  # alpha = 1 copies the policy
    # The next step's margins are 0 again.
    assert _sgd_step(model, mbs, [term], ctx)["loss/replay"] == pytest.approx(math.log(2), rel=1e-6)


def test_a_reference_that_never_refreshes_is_refused() -> None:
    with pytest.raises(ValueError, match="never refreshes"):
        DPOLossConfig(weight=1.0, reference="refreshed", ref_sync_steps=None)


def test_the_summary_reports_the_heldout_trend() -> None:
    from prime_composer.channels.replay import summary

    run = {
        "trainer": [
            {"step": 0, "dpo_heldout/accuracy": 0.25, "dpo_heldout/margin": -0.01},
            {"step": 1, "loss/replay": 0.6},
            {"step": 2, "dpo_heldout/accuracy": 0.75, "dpo_heldout/margin": 0.2},
        ]
    }
    assert summary(run) == [
        "replay held-out pairs: DPO accuracy 0.25 -> 0.75, margin -0.010 -> 0.200 (2 scorings)"
    ]


def test_the_summary_reports_the_gates_calibration() -> None:
    from prime_composer.channels.replay import summary

    last = {
        "teacher/spent_usd": 0.5,
        "teacher/gate_labels": 12,
        "teacher/gate_ece": 0.125,
        "teacher/gate_brier": 0.2,
    }
    assert "teacher gate: ECE 0.125, Brier 0.200 over 12 labeled steps" in summary({"teacher": [last]})

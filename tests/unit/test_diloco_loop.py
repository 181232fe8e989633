"""The shardcast outer loop in a single DC (no network): schedule, outer step, merge, exact resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prime_composer.config.diloco import DilocoConfig, OuterOptimConfig
from prime_composer.diloco.loop import ShardcastOuterLoop


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))


def _train(
    model: torch.nn.Module, outer: ShardcastOuterLoop, opt: torch.optim.Optimizer, steps: range
) -> list[bool]:
    changed = []
    g = torch.Generator().manual_seed(steps.start)
    for step in steps:
        loss = model(torch.randn(4, 6, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        changed.append(outer.after_inner_step(step, 4, skipped=False))
    return changed


def test_lr_one_no_momentum_single_dc_global_follows_local(tmp_path: Path) -> None:
    model = _model()
    cfg = DilocoConfig(sync_every=3, quantization="none", outer=OuterOptimConfig(lr=1.0, momentum=0.0))
    outer = ShardcastOuterLoop(cfg, model, None, tmp_path)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    changed = _train(model, outer, opt, range(3))
    assert changed == [False, False, True]
    local = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(outer.theta[0], local, rtol=0, atol=1e-7)
    outer.close()


def test_outer_step_and_alpha_merge_by_hand(tmp_path: Path) -> None:
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    cfg = DilocoConfig(sync_every=1, quantization="none", fragment_update_alpha=0.25)
    outer = ShardcastOuterLoop(cfg, model, None, tmp_path)
    with torch.no_grad():
        model.weight.fill_(0.8)  # an inner step moved the weight by -0.2
    assert outer.after_inner_step(0, 1, skipped=False)
    # g = 1 - 0.8 = 0.2, nesterov d = 0.2 + 0.9 * 0.2 = 0.38, global = 1 - 0.7 * 0.38 = 0.734;
    # local = 0.25 * 0.8 + 0.75 * 0.734 = 0.7505
    torch.testing.assert_close(outer.theta[0], torch.tensor([0.734]))
    torch.testing.assert_close(model.weight.detach().reshape(1), torch.tensor([0.7505]))
    outer.close()


def test_skipped_updates_do_not_shift_the_schedule(tmp_path: Path) -> None:
    model = _model()
    outer = ShardcastOuterLoop(
        DilocoConfig(sync_every=4, num_fragments=2, quantization="none"), model, None, tmp_path
    )
    applied = []
    for step in range(12):
        skipped = step % 3 == 1
        outer.after_inner_step(step, 1, skipped)
        if outer.last_result is not None and outer.last_metrics["diloco/round"] == len(applied):
            applied.append(step)
    # 8 applied updates in 12 steps (4 skipped): syncs after applied updates 2, 4, 6, 8.
    assert outer.num_updates == 8
    assert applied == [2, 5, 8, 11]
    outer.close()


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_resume_is_exact(tmp_path: Path, quantization: str) -> None:
    cfg = DilocoConfig(
        sync_every=4, num_fragments=2, fragment_sync_delay=1, quantization=quantization, error_feedback=True
    )

    def fresh() -> tuple[torch.nn.Module, ShardcastOuterLoop, torch.optim.Optimizer]:
        model = _model()
        return (
            model,
            ShardcastOuterLoop(cfg, model, None, tmp_path),
            torch.optim.SGD(model.parameters(), lr=0.1),
        )

    model, outer, opt = fresh()
    _train(model, outer, opt, range(0, 5))
    _train(model, outer, opt, range(5, 13))
    straight = (outer.global_digest(), [p.detach().clone() for p in model.parameters()])
    outer.close()

    model, outer, opt = fresh()
    _train(model, outer, opt, range(0, 5))  # after 5 updates a sync is in flight (started at 4, tau 1)
    outer.save(tmp_path / "ckpt", 5)
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    outer.close()

    model, outer, opt = fresh()
    model.load_state_dict(model_state)
    outer.load(tmp_path / "ckpt", 5)
    _train(model, outer, opt, range(5, 13))
    assert outer.global_digest() == straight[0]
    for p, q in zip(model.parameters(), straight[1], strict=True):
        assert torch.equal(p.detach(), q)
    outer.close()

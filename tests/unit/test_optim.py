"""Optimizer: schedule values by hand, decay only on matrices, gradient clipping by hand."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from prime_composer.config.optim import OptimConfig
from prime_composer.trainer.optim import build_optimizer, clip_grad_norm, lr_factor


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
        # 3 decay steps after 2 warmup steps, from 1 down to 0.1: 1 - 0.9 * k / 3
        ("linear", [0.5, 1.0, 1.0, 0.7, 0.4, 0.1]),
        # 0.1 + 0.9 * (1 + cos(pi * k / 3)) / 2
        ("cosine", [0.5, 1.0, 1.0, 0.775, 0.325, 0.1]),
    ],
)
def test_lr_factor_by_hand(schedule, expected):
    cfg = OptimConfig(lr=0.5, warmup_steps=2, schedule=schedule, min_lr_ratio=0.1)
    got = [lr_factor(s, cfg, max_steps=6) for s in range(6)]
    assert got == pytest.approx(expected, abs=1e-12)


def test_scheduler_sets_lr_of_each_step():
    cfg = OptimConfig(lr=0.5, warmup_steps=2, schedule="linear", min_lr_ratio=0.1)
    model = nn.Linear(2, 2)
    optimizer, scheduler = build_optimizer(model, cfg, max_steps=6)
    used = []
    for _ in range(6):
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert used == pytest.approx([0.25, 0.5, 0.5, 0.35, 0.2, 0.05])
    assert {g["lr"] for g in optimizer.param_groups} == {optimizer.param_groups[0]["lr"]}


def test_one_step_no_decay_edge_cases():
    assert lr_factor(0, OptimConfig(schedule="cosine", min_lr_ratio=0.5), max_steps=1) == 0.5
    with pytest.raises(ValidationError, match="beta"):
        OptimConfig(betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="max_steps"):
        build_optimizer(nn.Linear(2, 2), OptimConfig(), max_steps=0)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.proj = nn.Linear(4, 4, bias=True)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight  # tied, like the tiny model's output head


def test_weight_decay_only_on_matrices():
    torch.manual_seed(0)
    model = _Block()
    lr, wd = 0.1, 0.5
    optimizer, _ = build_optimizer(model, OptimConfig(lr=lr, weight_decay=wd), max_steps=1)
    decayed = {id(p) for p in optimizer.param_groups[0]["params"]}
    plain = {id(p) for p in optimizer.param_groups[1]["params"]}
    assert decayed == {id(model.embed.weight), id(model.proj.weight)}  # tied head counted once
    assert plain == {id(model.proj.bias), id(model.norm.weight), id(model.norm.bias)}

    # With zero gradients AdamW's update is 0, so one step is pure decoupled decay:
    # p <- p * (1 - lr * wd) for matrices, unchanged for norms and biases.
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, p in model.named_parameters():
        factor = 1 - lr * wd if p.ndim >= 2 else 1.0
        torch.testing.assert_close(p.detach(), before[name] * factor, rtol=0, atol=1e-7)


def test_clip_grad_norm_by_hand():
    model = nn.Linear(2, 1)  # weight [1, 2], bias [1]
    model.weight.grad = torch.tensor([[3.0, 0.0]])
    model.bias.grad = torch.tensor([4.0])
    norm = clip_grad_norm(model, max_norm=1.0)
    assert norm.item() == pytest.approx(5.0)  # sqrt(3^2 + 4^2), before clipping
    assert model.weight.grad[0].tolist() == pytest.approx([0.6, 0.0], abs=1e-6)
    assert model.bias.grad.tolist() == pytest.approx([0.8], abs=1e-6)

    # max_norm 0 only measures; a norm already below max_norm is left as is.
    assert clip_grad_norm(model, max_norm=0.0).item() == pytest.approx(1.0, abs=1e-6)
    assert clip_grad_norm(model, max_norm=10.0).item() == pytest.approx(1.0, abs=1e-6)
    assert model.bias.grad.tolist() == pytest.approx([0.8], abs=1e-6)


def test_clip_grad_norm_non_finite_leaves_grads():
    model = nn.Linear(2, 1)
    model.weight.grad = torch.tensor([[math.inf, 1.0]])
    model.bias.grad = torch.tensor([2.0])
    norm = clip_grad_norm(model, max_norm=1.0)
    assert not torch.isfinite(norm)
    assert model.bias.grad.item() == 2.0
    assert clip_grad_norm(nn.Linear(2, 1), max_norm=1.0).item() == 0.0  # no grads yet

"""The outer Nesterov step against a hand computation and against torch.optim.SGD."""

from __future__ import annotations

import torch

from prime_composer.config.diloco import OuterOptimConfig
from prime_composer.diloco.outer_optim import outer_step, weighted_average


def test_two_nesterov_steps_by_hand() -> None:
    cfg = OuterOptimConfig(lr=0.5, momentum=0.9, nesterov=True)
    theta, buf = torch.tensor([1.0]), torch.zeros(1)
    outer_step(theta, buf, torch.tensor([0.2]), cfg)
    # b = 0.2; d = 0.2 + 0.9 * 0.2 = 0.38; theta = 1 - 0.5 * 0.38 = 0.81
    torch.testing.assert_close(theta, torch.tensor([0.81]))
    outer_step(theta, buf, torch.tensor([-0.1]), cfg)
    # b = 0.9 * 0.2 - 0.1 = 0.08; d = -0.1 + 0.9 * 0.08 = -0.028; theta = 0.81 + 0.014 = 0.824
    torch.testing.assert_close(buf, torch.tensor([0.08]))
    torch.testing.assert_close(theta, torch.tensor([0.824]))


def test_matches_torch_sgd_over_several_steps() -> None:
    for nesterov in (True, False):
        cfg = OuterOptimConfig(lr=0.7, momentum=0.9, nesterov=nesterov)
        g = torch.Generator().manual_seed(0)
        theta = torch.randn(50, generator=g)
        reference = torch.nn.Parameter(theta.clone())
        sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=nesterov)
        buf = torch.zeros(50)
        for _ in range(5):
            grad = torch.randn(50, generator=g)
            outer_step(theta, buf, grad, cfg)
            reference.grad = grad.clone()
            sgd.step()
        torch.testing.assert_close(theta, reference.detach(), rtol=1e-6, atol=1e-6)


def test_lr_one_without_momentum_is_averaging_the_local_models() -> None:
    cfg = OuterOptimConfig(lr=1.0, momentum=0.0)
    theta = torch.tensor([1.0, 2.0])
    locals_ = [torch.tensor([3.0, 2.0]), torch.tensor([0.0, 5.0])]
    # Tokens 1 and 3: weighted mean of the local models is (3 + 0) / 4, (2 + 15) / 4.
    grad = weighted_average([(1.0, theta - locals_[0]), (3.0, theta - locals_[1])])
    outer_step(theta, torch.zeros(2), grad, cfg)
    torch.testing.assert_close(theta, torch.tensor([0.75, 4.25]))

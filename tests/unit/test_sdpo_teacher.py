"""The SDPO teacher: EMA math by hand, frozen stays, live shares, logits at the right positions."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from prime_composer.model.resolve import resolve_model_name
from prime_composer.trainer.policy_copy import PolicyCopy


def _linear(w: list[list[float]], b: list[float]) -> nn.Linear:
    layer = nn.Linear(2, 2)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(w))
        layer.bias.copy_(torch.tensor(b))
    return layer


def test_ema_update_by_hand():
    policy = _linear([[1.0, 2.0], [3.0, 4.0]], [0.0, 1.0])
    teacher = PolicyCopy(policy, "ema", ema_rate=0.75)
    assert teacher.module is not policy
    with torch.no_grad():
        policy.weight.copy_(torch.tensor([[5.0, 2.0], [-1.0, 0.0]]))
        policy.bias.copy_(torch.tensor([4.0, 1.0]))
    teacher.update(policy)
    # 0.75 * old + 0.25 * new, element by element.
    assert teacher.module.weight.tolist() == [[2.0, 2.0], [2.0, 3.0]]
    assert teacher.module.bias.tolist() == [1.0, 1.0]
    teacher.update(policy)  # again toward the same policy: 0.75 * 2 + 0.25 * 5 = 2.75, ...
    assert teacher.module.weight.tolist() == [[2.75, 2.0], [1.25, 2.25]]
    assert not any(p.requires_grad for p in teacher.module.parameters())
    assert all(p.requires_grad for p in policy.parameters())


def test_frozen_stays_at_the_initial_policy():
    policy = _linear([[1.0, 2.0], [3.0, 4.0]], [0.0, 1.0])
    teacher = PolicyCopy(policy, "frozen")
    with torch.no_grad():
        policy.weight.add_(1.0)
    teacher.update(policy)
    assert teacher.module.weight.tolist() == [[1.0, 2.0], [3.0, 4.0]]


def test_live_shares_the_policy_and_gives_no_gradient():
    policy = _linear([[1.0, 2.0], [3.0, 4.0]], [0.0, 1.0])
    teacher = PolicyCopy(policy, "live")
    assert teacher.module is policy
    teacher.update(policy)
    assert policy.weight.tolist() == [[1.0, 2.0], [3.0, 4.0]]


def test_make_copy_gets_the_policy_weights():
    policy = _linear([[1.0, 2.0], [3.0, 4.0]], [0.0, 1.0])
    teacher = PolicyCopy(policy, "ema", make_copy=lambda: nn.Linear(2, 2))
    assert teacher.module.weight.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    with pytest.raises(ValueError, match="different parameters"):
        PolicyCopy(policy, "ema", make_copy=lambda: nn.Linear(2, 2, bias=False))


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    path = resolve_model_name("builtin:tiny-qwen3")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")


class _NoKeep(nn.Module):
    """Wraps the model behind a forward without ``logits_to_keep`` (the full-logits path)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, position_ids, use_cache):
        return self.inner(input_ids=input_ids, position_ids=position_ids, use_cache=use_cache)


@pytest.mark.parametrize("wrap", [False, True])
def test_logits_at_target_positions_match_separate_forwards(tiny, wrap):
    torch.manual_seed(1)
    a = torch.randint(3, 400, (9,))
    b = torch.randint(3, 400, (6,))
    c = torch.randint(3, 400, (11,))
    # Row 0 packs a and b, row 1 holds c and padding. Targets: a[6:9], b[2:4], c[9:11].
    input_ids = torch.zeros(2, 16, dtype=torch.long)
    position_ids = torch.zeros(2, 16, dtype=torch.long)
    mask = torch.zeros(2, 16, dtype=torch.bool)
    input_ids[0, :9], input_ids[0, 9:15], input_ids[1, :11] = a, b, c
    position_ids[0, :9], position_ids[0, 9:15] = torch.arange(9), torch.arange(6)
    position_ids[0, 15], position_ids[1, :11], position_ids[1, 11:] = 0, torch.arange(11), torch.arange(5)
    mask[0, 6:9] = mask[0, 11:13] = mask[1, 9:11] = True
    policy = _NoKeep(tiny) if wrap else tiny
    teacher = PolicyCopy(policy, "live")
    head_shapes = []
    handle = tiny.lm_head.register_forward_hook(lambda m, i, out: head_shapes.append(tuple(out.shape)))
    try:
        got = teacher.target_logits(input_ids, position_ids, mask, temperature=0.5)
    finally:
        handle.remove()
    # With an output head, it maps only the 7 predicting positions, not all 2 x 16.
    assert head_shapes == [(2, 16, tiny.config.vocab_size) if wrap else (1, 7, tiny.config.vocab_size)]
    assert teacher.num_forwards == 1 and not got.requires_grad
    with torch.no_grad():
        expected = (
            torch.cat(
                [
                    tiny(seq[None]).logits[0, lo - 1 : hi - 1]
                    for seq, lo, hi in ((a, 6, 9), (b, 2, 4), (c, 9, 11))
                ]
            )
            / 0.5
        )
    assert got.shape == (7, tiny.config.vocab_size)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_live_teacher_logits_are_detached_even_with_grad_enabled(tiny):
    teacher = PolicyCopy(tiny, "live")
    ids = torch.randint(3, 400, (1, 8))
    mask = torch.zeros(1, 8, dtype=torch.bool)
    mask[0, 4:] = True
    with torch.enable_grad():
        out = teacher.target_logits(ids, torch.arange(8)[None], mask, temperature=1.0)
    assert out.grad_fn is None and not out.requires_grad

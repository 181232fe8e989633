"""The SDPO teacher under FSDP2 on 2 CPU ranks (gloo): EMA on local shards, teacher forwards in step.

Checked against hand computations on the gathered weights (EMA: ``0.75 * w + 0.25 * 1.1 * w``) and
against a plain unsharded forward of a model holding the gathered teacher weights.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from sdpo_fsdp_worker import COMPLETION, MODEL, RATE, TEACHER_PREFIX

from prime_composer.trainer.model import load_model

pytestmark = pytest.mark.slow  # more than ~30 s on 2 cores: left out of the fast lane


def test_ema_teacher_on_two_fsdp_ranks(two_rank_runs: Callable[[str], Path]) -> None:
    out = two_rank_runs("sdpo_fsdp")  # sdpo_fsdp_worker.main, in two_rank_workers.py's torchrun
    r0 = torch.load(out / "rank0.pt", weights_only=True)
    r1 = torch.load(out / "rank1.pt", weights_only=True)

    # The copy started as the policy; the EMA moved it a quarter of the way to 1.1 x.
    for name, w in r0["before"].items():
        if not w.is_floating_point():
            continue
        torch.testing.assert_close(r0["policy"][name], 1.1 * w, rtol=1e-6, atol=1e-7, msg=name)
        expected = RATE * w + (1 - RATE) * 1.1 * w
        torch.testing.assert_close(r0["teacher"][name], expected, rtol=1e-6, atol=1e-7, msg=name)

    # Both ranks ran the teacher forward (rank 1 a dummy one): no deadlock, and rank 1 got no rows.
    assert r0["run_teacher"] == r1["run_teacher"] == [True]
    assert r0["num_forwards"] == 1 and r1["logits"].shape[0] == 0
    assert r0["normalizer"] == 3.0  # the hinted span is 3 tokens, counted over both ranks

    model, _ = load_model(MODEL, torch.device("cpu"))
    model.load_state_dict(r0["teacher"])
    ids = torch.tensor([TEACHER_PREFIX + COMPLETION[1:]])
    with torch.no_grad():
        expected_logits = model(ids).logits[0, len(TEACHER_PREFIX) - 1 : -1]
    torch.testing.assert_close(r0["logits"], expected_logits, rtol=1e-5, atol=1e-5)

"""The staggered fragment schedule and fragment splitting."""

from __future__ import annotations

import torch

from prime_composer.diloco.fragments import split_fragments
from prime_composer.diloco.schedule import FragmentSchedule


def test_each_fragment_syncs_once_every_h_updates_with_tau_overlap() -> None:
    s = FragmentSchedule(sync_every=12, num_fragments=3, sync_delay=2)
    starts = {c: s.starts_after(c) for c in range(40) if s.starts_after(c) is not None}
    applies = {c: s.applies_after(c) for c in range(40) if s.applies_after(c) is not None}
    assert starts == {4: 0, 8: 1, 12: 2, 16: 3, 20: 4, 24: 5, 28: 6, 32: 7, 36: 8}
    assert applies == {c + 2: k for c, k in starts.items() if c + 2 < 40}
    by_fragment = {f: [c for c, k in starts.items() if s.fragment(k) == f] for f in range(3)}
    assert by_fragment == {0: [4, 16, 28], 1: [8, 20, 32], 2: [12, 24, 36]}


def test_fragments_are_consecutive_and_balanced() -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(10, 10) for _ in range(4)])
    fragments = split_fragments(model, 2)
    names = [n for f in fragments for n in f.names]
    assert names == [n for n, _ in model.named_parameters()]
    assert [f.numel for f in fragments] == [220, 220]
    assert len(split_fragments(model, 8)) == 8  # one tensor each

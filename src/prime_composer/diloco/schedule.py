"""Which fragment syncs when: Streaming DiLoCo's staggered schedule, counted in applied updates.

The clock is the number of inner updates actually applied (a step whose update was skipped for a
non-finite loss does not move it), so a skipped step never shifts the schedule. With
``S = H / P`` (``steps_per_fragment``) and ``c`` updates applied so far:

- sync ``k`` (of fragment ``k % P``) *starts* when ``c = (k + 1) * S``: the pseudo-gradient is
  taken and the exchange begins in the background;
- its result is *applied* when ``c = (k + 1) * S + tau``, after ``tau`` more inner steps.

So every fragment syncs once every H updates, fragment ``p`` first after ``(p + 1) * S``, and at
most one exchange is in flight (``tau < S``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FragmentSchedule:
    sync_every: int
    num_fragments: int
    sync_delay: int

    def __post_init__(self) -> None:
        assert self.sync_every % self.num_fragments == 0, "validated in DilocoConfig"
        assert 0 <= self.sync_delay < self.steps_per_fragment, "validated in DilocoConfig"

    @property
    def steps_per_fragment(self) -> int:
        return self.sync_every // self.num_fragments

    def fragment(self, sync_index: int) -> int:
        """The fragment sync ``sync_index`` exchanges."""
        return sync_index % self.num_fragments

    def starts_after(self, num_updates: int) -> int | None:
        """The sync that starts once ``num_updates`` inner updates are applied, if any."""
        s = self.steps_per_fragment
        if num_updates > 0 and num_updates % s == 0:
            return num_updates // s - 1
        return None

    def applies_after(self, num_updates: int) -> int | None:
        """The sync whose result is applied once ``num_updates`` inner updates are applied, if any."""
        return self.starts_after(num_updates - self.sync_delay) if num_updates > self.sync_delay else None

    def start_of(self, sync_index: int) -> int:
        """Inner updates applied when sync ``sync_index`` starts."""
        return (sync_index + 1) * self.steps_per_fragment

"""The launcher's live view of a run, read from the processes' metrics files.

On a terminal it is a rich panel that refreshes in place; elsewhere (CI, a log file) it prints
one plain line per new trainer step. It only reads ``<output_dir>/metrics/*.jsonl``, so it shows
the same numbers a user would plot afterwards. The final eval runs after the trainer's last step
(``orchestrator/loop.py`` logs it under step ``max_steps``), so no step's line can show it:
``close`` prints one more line for that step.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table

from prime_composer.config.channels import Column, channels
from prime_composer.metrics import MetricsTail

# Shown when present, the first matching key of each winning; every channel's columns go
# between these (``config/channels.py``: ``ChannelSpec.columns``).
HEAD_COLUMNS: tuple[Column, ...] = (
    Column("reward", "orchestrator", ("reward/mean",)),
    Column("eval acc", "orchestrator", ("eval/accuracy",)),
    Column("loss", "trainer", ("loss/total", "loss")),
)
TAIL_COLUMNS: tuple[Column, ...] = (Column("tokens/s", "trainer", ("perf/tokens_per_s",)),)


def columns() -> list[Column]:
    """The progress line's columns: the run's own, then every registered channel's."""
    return [*HEAD_COLUMNS, *(c for spec in channels() for c in spec.columns), *TAIL_COLUMNS]


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


class Progress:
    def __init__(
        self, metrics_dir: Path, max_steps: int, *, live: bool, console: Console | None = None
    ) -> None:
        self.metrics_dir = metrics_dir
        self.max_steps = max_steps
        self.console = console or Console(stderr=False)
        self.live = live and self.console.is_terminal
        self.start = time.monotonic()
        self._last_printed_step = -1
        self._statuses: dict[str, str] = {}
        self._live: Live | None = None
        self._tails: dict[str, MetricsTail] = {}
        """One per process: each tick parses only the lines appended since the last (the launcher
        ticks five times a second, and the teacher service's file grows by hundreds of lines)."""

    def _records(self, process: str) -> list[dict[str, Any]]:
        tail = self._tails.get(process)
        if tail is None:
            tail = self._tails[process] = MetricsTail(self.metrics_dir / f"{process}.jsonl")
        return tail.read()

    def latest(self, processes: set[str]) -> dict[str, dict[str, Any]]:
        return {
            process: (records[-1] if (records := self._records(process)) else {})
            for process in {"trainer", *processes}
        }

    def values(self, *, final: bool = False) -> tuple[int, list[tuple[str, Any]]]:
        """The step shown and its ``(label, value)`` columns: the trainer's newest step. ``final``
        (the run has ended): the orchestrator's record at or after ``max_steps`` instead, when
        there is one (the final eval, run after the trainer's last step), with only what that
        record holds."""
        shown_columns = columns()
        latest = self.latest({column.process for column in shown_columns})
        step = int(latest["trainer"].get("step", 0))
        records = self._records("orchestrator")
        end = [r for r in records if final and r.get("step", 0) >= max(self.max_steps, step + 1)]
        if end:
            step = int(end[-1]["step"])
            records = [r for r in end if r["step"] == step]
            shown_columns = [c for c in shown_columns if c.process == "orchestrator"]
        # The orchestrator samples up to max_async_level steps ahead of the trainer, so its newest
        # record is a later batch than the trainer's step: show the record of the same step (for a
        # key logged every few steps, like eval/accuracy, the newest at or before it).
        orchestrator = [r for r in records if r.get("step", 0) <= step]
        shown = []
        for column in shown_columns:
            for key in column.keys:
                record: dict[str, Any]
                if column.process == "orchestrator":
                    record = next((r for r in reversed(orchestrator) if key in r), {})
                else:
                    record = latest[column.process]
                if key in record:
                    shown.append((column.label, record[key]))
                    break
        return step, shown

    def tick(self, statuses: dict[str, str]) -> None:
        self._statuses = statuses
        self._show(*self.values())

    def _show(self, step: int, shown: list[tuple[str, Any]]) -> None:
        statuses = self._statuses
        if self.live:
            if self._live is None:
                self._live = Live(
                    self._render(step, shown, statuses), console=self.console, auto_refresh=False
                )
                self._live.start()
            self._live.update(self._render(step, shown, statuses), refresh=True)
        elif step > self._last_printed_step and shown:
            self._last_printed_step = step
            parts = " ".join(f"{label}={_fmt(v)}" for label, v in shown)
            print(
                f"step {step}/{self.max_steps} {parts} elapsed={time.monotonic() - self.start:.0f}s",
                flush=True,
            )

    def close(self) -> None:
        """Show the run's end (the final eval, logged after the last trainer step), then stop."""
        if self._live is not None or not self.live:
            self._show(*self.values(final=True))
        if self._live is not None:
            self._live.stop()
            self._live = None

    def _render(self, step: int, shown: list[tuple[str, Any]], statuses: dict[str, str]) -> Table:
        table = Table.grid(padding=(0, 2))
        bar = ProgressBar(total=self.max_steps, completed=step, width=40)
        header = Table.grid(padding=(0, 1))
        header.add_row(f"step {step}/{self.max_steps}", bar, f"{time.monotonic() - self.start:.0f}s")
        table.add_row(header)
        metrics = Table(box=None, show_header=True, header_style="bold")
        for label, _ in shown:
            metrics.add_column(label, justify="right")
        if shown:
            metrics.add_row(*(_fmt(v) for _, v in shown))
            table.add_row(metrics)
        table.add_row("  ".join(f"{name}: {status}" for name, status in statuses.items()))
        return table


def is_terminal() -> bool:
    return sys.stdout.isatty()

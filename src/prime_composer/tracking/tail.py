"""Read what the processes appended to ``metrics/<process>.jsonl`` since the last look.

``metrics.MetricsLogger`` appends whole lines with one ``write``; a reader can still catch a line
that is being written, so only text up to the last newline is taken and the rest waits for the
next call. A file that got shorter was rewritten (``rl --resume`` trims the steps it will log
again): it is read again from the start.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsTail:
    """New records of every ``*.jsonl`` under ``metrics_dir``, as ``(process, record)`` pairs."""

    def __init__(self, metrics_dir: Path) -> None:
        self.metrics_dir = Path(metrics_dir)
        self._offsets: dict[Path, int] = {}

    def new_records(self) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        for path in sorted(self.metrics_dir.glob("*.jsonl")):
            offset = self._offsets.get(path, 0)
            try:
                size = path.stat().st_size
                if size < offset:
                    offset = 0
                with open(path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except FileNotFoundError:
                continue
            end = chunk.rfind(b"\n") + 1
            self._offsets[path] = offset + end
            for line in chunk[:end].decode("utf-8", errors="replace").splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict) and isinstance(record.get("step"), int):
                    out.append((path.stem, record))
        return out

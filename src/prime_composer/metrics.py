"""Per-process metrics as JSON lines: ``<output_dir>/metrics/<process>.jsonl``.

Each line is one step: ``{"step": N, "time": <unix s>, "<group>/<name>": value, ...}``. Lines are
appended and flushed whole, so a reader (the launcher's progress display, ``report.png``) never
sees half a record even while the writer is running; a crash loses at most the line being
written.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any


class MetricsLogger:
    """Appends one JSON object per call to ``<output_dir>/metrics/<process>.jsonl``."""

    def __init__(self, output_dir: Path, process: str) -> None:
        self.path = Path(output_dir) / "metrics" / f"{process}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "time": round(time.time(), 3)}
        for key, value in metrics.items():
            value = float(value) if hasattr(value, "item") else value
            # JSON has no NaN/inf; keep the key so a plot shows the gap, as null.
            if isinstance(value, float) and not math.isfinite(value):
                value = None
            record[key] = value
        line = json.dumps(record) + "\n"
        # One write() of the whole line on an O_APPEND file: concurrent readers see whole lines.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All complete records of a metrics file (a trailing partial line is ignored)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class MetricsTail:
    """The records of one metrics file, reading on each ``read()`` only the bytes appended since
    the last (``read_metrics`` parses the whole file every time: a display that polls a growing
    file that way spends CPU quadratic in the run's length). A trailing partial line is kept for the
    next read; a file that was replaced (another inode) or shrank is read again from the start."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.records: list[dict[str, Any]] = []
        self._offset = 0
        self._inode: int | None = None
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                stat = os.fstat(f.fileno())
                if stat.st_ino != self._inode or stat.st_size < self._offset:
                    self.records, self._offset, self._partial, self._inode = [], 0, b"", stat.st_ino
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return self.records
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            try:
                self.records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return self.records

"""The end-of-run report: ``<output_dir>/report.png`` and a one-screen text summary.

Both are built only from ``<output_dir>/metrics/*.jsonl``, so ``python -m prime_composer.report
<output_dir>`` re-creates them for any run, finished or not.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

from prime_composer.config.channels import Column, channels
from prime_composer.io import atomic_write_bytes
from prime_composer.metrics import read_metrics

# (title, process, metric keys tried in order); every channel's panels follow
# (``config/channels.py``: ``ChannelSpec.panels``).
HEAD_PANELS: tuple[Column, ...] = (
    Column("reward (train samples)", "orchestrator", ("reward/mean",)),
    Column("loss", "trainer", ("loss/total", "loss")),
    Column("held-out accuracy", "orchestrator", ("eval/accuracy",)),
)


def panels() -> list[Column]:
    return [*HEAD_PANELS, *(p for spec in channels() for p in spec.panels)]


def _series(records: list[dict[str, Any]], keys: tuple[str, ...]) -> tuple[list[int], list[float], str]:
    for key in keys:
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if points:
            steps, values = zip(*points, strict=True)
            return list(steps), list(values), key
    return [], [], keys[0]


def load_run(output_dir: Path) -> dict[str, list[dict[str, Any]]]:
    metrics = Path(output_dir) / "metrics"
    return {p.stem: read_metrics(p) for p in sorted(metrics.glob("*.jsonl"))}


def write_report_png(output_dir: Path) -> Path | None:
    """Plot every panel that has data; returns the path, or None when there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    run = load_run(output_dir)
    shown = []
    for panel in panels():
        steps, values, key = _series(run.get(panel.process, []), panel.keys)
        if steps:
            shown.append((panel.label, steps, values, key))
    if not shown:
        return None
    cols = min(2, len(shown))
    rows = (len(shown) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.2 * rows), squeeze=False)
    for ax, (title, steps, values, key) in zip(axes.flat, shown, strict=False):
        ax.plot(steps, values, marker="o", markersize=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(shown) :]:
        ax.axis("off")
    fig.suptitle(str(output_dir))
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    path = Path(output_dir) / "report.png"
    atomic_write_bytes(path, buffer.getvalue())
    return path


def summary(output_dir: Path) -> str:
    """A few lines: steps done, first/last reward, held-out accuracy, throughput."""
    run = load_run(output_dir)
    lines = [f"run: {output_dir}"]
    orch, trainer = run.get("orchestrator", []), run.get("trainer", [])
    _, rewards, _ = _series(orch, ("reward/mean",))
    if rewards:
        first, last = rewards[:3], rewards[-5:]
        lines.append(
            f"reward: first {len(first)} steps {sum(first) / len(first):.3f} -> "
            f"last {len(last)} steps {sum(last) / len(last):.3f} ({len(rewards)} steps)"
        )
    _, accuracy, _ = _series(orch, ("eval/accuracy",))
    if accuracy:
        lines.append(f"held-out accuracy: {accuracy[0]:.3f} -> {accuracy[-1]:.3f}")
    _, speed, _ = _series(trainer, ("perf/tokens_per_s",))
    if speed:
        lines.append(f"trainer: {sum(speed) / len(speed):,.0f} tokens/s on average")
    if trainer:
        wall = trainer[-1]["time"] - trainer[0]["time"]
        lines.append(f"trainer steps: {trainer[-1]['step']} in {wall:.0f} s")
    for spec in channels():
        if spec.summary is not None:
            lines += spec.summary(run)
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) != 2:
        print("usage: python -m prime_composer.report <output_dir>", file=sys.stderr)
        sys.exit(2)
    path = write_report_png(Path(sys.argv[1]))
    print(summary(Path(sys.argv[1])))
    print(f"report: {path}" if path else "report: no metrics to plot yet")


if __name__ == "__main__":
    main()

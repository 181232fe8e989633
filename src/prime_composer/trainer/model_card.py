"""The model card (``README.md``) of an exported model directory, built from the run directory.

It lists what a reader of the Hugging Face directory needs to trust it: the base model (the one
before an SFT warm-up, when there was one), the training config (``configs/rl.json``, secrets
are never in it), the reward curve's start and end (``metrics/orchestrator.jsonl``), the held-out
accuracy measured during training, and the standalone evaluations (``uv run eval``) written under
``<output_dir>/eval/*/summary.json``. Everything comes from files, so the card can be rewritten
at any time (the launcher does once the run is over, ``uv run eval`` after evaluating the export).

No torch import: the launcher writes cards too.
"""

from __future__ import annotations

import json
from pathlib import Path
from statistics import fmean
from typing import Any

from prime_composer.io import atomic_write_text
from prime_composer.metrics import read_metrics

CARD_NAME = "README.md"
CARD_MARKER = "<!-- written by prime-composer -->"
"""First line of every card this module writes (a card someone else wrote is never replaced)."""
EVAL_SUMMARY = "summary.json"
NUM_ENDPOINT_STEPS = 5
"""The curve's start and end are each the mean of this many steps (one step's reward is noisy)."""


def base_model(output_dir: Path) -> tuple[str, bool]:
    """``(name, warmed_up)``: the model the run started from, and whether an SFT warm-up came first."""
    configs = Path(output_dir) / "configs"
    sft = _read_json(configs / "sft.json")
    if sft is not None:
        return str(sft["model"]["name"]), True
    rl = _read_json(configs / "rl.json") or _read_json(configs / "trainer.json") or {}
    return str(rl.get("model", {}).get("name", "unknown")), False


def reward_curve(output_dir: Path) -> dict[str, Any] | None:
    """Start and end of ``reward/mean`` (means of the first and last few steps), or None."""
    points = [
        (r["step"], r["reward/mean"])
        for r in read_metrics(Path(output_dir) / "metrics" / "orchestrator.jsonl")
        if isinstance(r.get("reward/mean"), int | float)
    ]
    if not points:
        return None
    k = min(NUM_ENDPOINT_STEPS, len(points))
    return {
        "num_steps": len(points),
        "first_steps": [points[0][0], points[k - 1][0]],
        "start": fmean(v for _, v in points[:k]),
        "last_steps": [points[-k][0], points[-1][0]],
        "end": fmean(v for _, v in points[-k:]),
    }


def training_evals(output_dir: Path) -> list[tuple[int, float]]:
    """``(step, eval/accuracy)`` of every evaluation during training."""
    return [
        (r["step"], r["eval/accuracy"])
        for r in read_metrics(Path(output_dir) / "metrics" / "orchestrator.jsonl")
        if isinstance(r.get("eval/accuracy"), int | float)
    ]


def standalone_evals(output_dir: Path, directory: Path) -> list[dict[str, Any]]:
    """The ``<output_dir>/eval/<name>/summary.json`` files (``uv run eval``) of the model in
    ``directory``, oldest first."""
    paths = sorted((Path(output_dir) / "eval").glob(f"*/{EVAL_SUMMARY}"), key=lambda p: p.stat().st_mtime)
    summaries = [s for p in paths if (s := _read_json(p)) is not None]
    target = Path(directory).resolve()
    return [s for s in summaries if s.get("checkpoint") and Path(s["checkpoint"]).resolve() == target]


def render_card(directory: Path, output_dir: Path) -> str:
    """The card of the model in ``directory``, trained by the run in ``output_dir``."""
    output_dir = Path(output_dir)
    name, warmed_up = base_model(output_dir)
    config = _read_json(output_dir / "configs" / "rl.json")
    lines = [
        CARD_MARKER,
        "---",
        f"base_model: {name}" if not name.startswith(("builtin:", "/", ".")) else f"# base_model: {name}",
        "library_name: transformers",
        "tags: [prime-composer, reinforcement-learning]",
        "---",
        "",
        f"# {output_dir.resolve().name}",
        "",
        f"Trained with prime-composer from **{name}**"
        + (" (an SFT warm-up, then RL)." if warmed_up else " with RL."),
    ]
    if config is not None:
        envs = ", ".join(e.get("name") or e["id"] for e in config.get("orchestrator", {}).get("env", []))
        lines.append(f"{config.get('max_steps')} steps on: {envs or 'no environment listed'}.")
    lines += ["", "## Reward", ""]
    curve = reward_curve(output_dir)
    if curve is None:
        lines.append("No reward was logged.")
    else:
        lines += [
            "| | steps | mean reward |",
            "|---|---|---|",
            f"| start | {curve['first_steps'][0]}-{curve['first_steps'][1]} | {curve['start']:.4f} |",
            f"| end | {curve['last_steps'][0]}-{curve['last_steps'][1]} | {curve['end']:.4f} |",
            "",
            f"({curve['num_steps']} steps logged; `metrics/orchestrator.jsonl` has the whole curve.)",
        ]
    lines += ["", "## Evaluation", ""]
    during = training_evals(output_dir)
    if during:
        (s0, a0), (s1, a1) = during[0], during[-1]
        lines.append(f"Held-out accuracy during training: {a0:.4f} at step {s0}, {a1:.4f} at step {s1}.")
    evals = standalone_evals(output_dir, directory)
    for summary in evals:
        lines += ["", f"`uv run eval` of `{summary.get('checkpoint')}` ({summary.get('num_samples', 1)} "
                      f"sample(s) per task, temperature {summary.get('temperature')}):", ""]  # fmt: skip
        lines += ["| environment | n | accuracy | 95% CI | pass@k |", "|---|---|---|---|---|"]
        for label, result in {**summary.get("envs", {}), "all": summary.get("overall", {})}.items():
            acc = result.get("accuracy") or {}
            passes = ", ".join(f"@{k}: {v:.4f}" for k, v in (result.get("pass_at_k") or {}).items())
            lines.append(
                f"| {label} | {result.get('n')} | {acc.get('mean', float('nan')):.4f} | "
                f"[{acc.get('ci_low', float('nan')):.4f}, {acc.get('ci_high', float('nan')):.4f}] "
                f"({acc.get('method')}) | {passes or '-'} |"
            )
    if not during and not evals:
        lines.append("No evaluation yet: `uv run eval @ <config> --checkpoint <this directory>`.")
    if config is not None:
        lines += ["", "## Config", "", "The resolved config of the run (`configs/rl.json`):", "", "```json",
                  json.dumps(config, indent=2), "```"]  # fmt: skip
    return "\n".join(lines) + "\n"


def write_model_card(directory: Path, output_dir: Path) -> Path | None:
    """Write ``<directory>/README.md`` for the run in ``output_dir``; returns its path, or None when
    ``directory`` holds a card this module did not write."""
    path = Path(directory) / CARD_NAME
    if path.exists() and not path.read_text(errors="replace").startswith(CARD_MARKER):
        return None
    atomic_write_text(path, render_card(directory, output_dir))
    path.chmod(0o644)
    return path


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None

"""``ablate @ configs/ablation.toml``: arms x seeds through the real ``rl`` launcher, one run at a
time, summarized as means over seeds with 95% Student-t intervals.

The config (every path relative to the file)::

    base = ["strops.toml"]          # rl configs every arm starts from
    output_dir = "outputs/ablation"
    seeds = [0, 1, 2]
    baseline = "grpo"               # paired differences are taken against this arm
    set = { max_steps = 20 }        # rl keys set for every arm (nested tables or dotted keys)

    [arms.grpo]                     # arms run in this order
    [arms.sdpo]
    configs = ["strops-sdpo.toml"]  # rl configs layered over base for this arm
    set = { "trainer.loss.sdpo.weight" = 0.5 }

Each arm-seed is ``rl @ <output_dir>/runs/<arm>/seed<S>.toml``, a generated file that includes
``base`` and the arm's ``configs`` and sets ``seed`` and ``output_dir``. When the arms warm up
(``warmup.enabled``), every arm of a seed starts from one warm-up, ``rl --warmup.only`` of ``base``
with that seed in ``<output_dir>/warmups/seed<S>`` (``share_warmup = false`` gives each arm-seed its
own): the arms then differ from their first step on only by what they set, and an ablation of
four arms trains a quarter of the warm-ups. Before anything runs, every arm is resolved with
``rl --dry-run`` (config errors surface before any time is spent) and the arms are checked to
train on the same samples: the same ``max_steps``, batch and group size, environments and warm-up.
A finished arm-seed leaves ``ablation-run.json`` with the digests of its generated config, its
metrics files and the warm-up's weights; a rerun skips it while they still match (resume), and
runs it again otherwise. A failed arm-seed is recorded with its exit status and the tail of its
output, shown in the table and left out of the means (never replaced by a number).

``--arms a,b`` and ``--seeds 0,1`` run a subset (the table then covers only it); ``--dry-run``
resolves and checks the arms and exits.

Arms whose teachers ``rl`` fine-tunes itself (``[teacher.pool.local]``) also get each teacher's
held-out accuracy: ``eval`` of the teacher's model on the run's eval split, once per distinct model
(``<output_dir>/teacher-evals/``), so the table shows whether the teachers know more than the
student they review.

Outputs: ``ablation.json`` (every run and every summary), ``ablation.md`` (the tables) and
``ablation.png`` (each arm's train reward and held-out accuracy per step: the mean over seeds and
its t band).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from prime_composer.config.errors import ConfigError
from prime_composer.eval.tstats import TInterval, paired_difference, t_interval
from prime_composer.integrity import bytes_digest, file_digest
from prime_composer.io import atomic_write_bytes, atomic_write_text
from prime_composer.metrics import read_metrics

RUN_RECORD = "ablation-run.json"
FAILED_RECORD = "ablation-failed.json"
WARMUP_RECORD = "ablation-warmup.json"
METRIC_FILES = ("orchestrator.jsonl", "trainer.jsonl", "teacher.jsonl")
SAME_SAMPLES_KEYS = (
    "max_steps",
    "orchestrator.batch_size",
    "orchestrator.group_size",
    "orchestrator.env",
    "orchestrator.sampling.max_tokens",
    "warmup",
)
"""Resolved rl keys that must agree across arms (the same samples and steps per arm)."""
WARMUP_KEYS = (
    "model",
    "warmup",
    "orchestrator.env",
    "orchestrator.seq_len",
    "trainer.optim",
    "trainer.num_threads",
)
"""Resolved rl keys the SFT warm-up reads: a shared warm-up must agree with every arm on these."""

_RL_SCHEDULE_KEYS = {"lr", "warmup_steps", "schedule", "min_lr_ratio"}
_TOP_KEYS = {"base", "output_dir", "seeds", "baseline", "set", "arms", "rl_command", "share_warmup"}
_ARM_KEYS = {"configs", "set"}


@dataclass
class Arm:
    name: str
    configs: list[Path] = field(default_factory=list)
    set: dict[str, Any] = field(default_factory=dict)


@dataclass
class AblationConfig:
    path: Path
    base: list[Path]
    output_dir: Path
    seeds: list[int]
    baseline: str
    set: dict[str, Any]
    arms: list[Arm]
    rl_command: list[str]
    share_warmup: bool = True


def _err(path: Path, key: str, message: str) -> ConfigError:
    return ConfigError(f"{path}: {key}: {message}")


def _paths(path: Path, key: str, value: Any) -> list[Path]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _err(path, key, f"{value!r} must be a file path or a list of paths")
    out = []
    for v in value:
        p = (path.parent / v).resolve()
        if not p.is_file():
            raise _err(path, key, f"{v!r} does not exist (paths are relative to {path.parent})")
        out.append(p)
    return out


def _nested(path: Path, key: str, value: Any) -> dict[str, Any]:
    """A ``set`` table with dotted keys expanded into nested tables."""
    if not isinstance(value, dict):
        raise _err(path, key, f"{value!r} must be a table of rl keys")
    out: dict[str, Any] = {}
    for dotted, v in value.items():
        parts = dotted.split(".")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise _err(path, f"{key}.{dotted}", "is set both as a value and as a table")
        leaf = parts[-1]
        if isinstance(v, dict):
            v = _nested(path, f"{key}.{dotted}", v)
            if isinstance(node.get(leaf), dict):
                v = _merge(node[leaf], v)
        node[leaf] = v
    return out


def _merge(low: dict[str, Any], high: dict[str, Any]) -> dict[str, Any]:
    out = dict(low)
    for k, v in high.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: Path, overrides: dict[str, Any] | None = None) -> AblationConfig:
    """Parse an ablation TOML file; every mistake is a ``ConfigError`` naming the key."""
    path = Path(path).resolve()
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such ablation config") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    overrides = dict(overrides or {})
    only_arms = overrides.pop("only_arms", None)
    data.update(overrides)
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise _err(path, unknown[0], f"unknown key; the keys are {', '.join(sorted(_TOP_KEYS))}")
    if "base" not in data:
        raise _err(path, "base", "missing: name the rl config(s) every arm starts from")
    base = _paths(path, "base", data["base"])
    seeds = data.get("seeds", [0, 1, 2])
    if (
        not isinstance(seeds, list)
        or not seeds
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)
        or len(set(seeds)) != len(seeds)
    ):
        raise _err(path, "seeds", f"{seeds!r} must be a non-empty list of distinct non-negative integers")
    output_dir = data.get("output_dir", "outputs/ablation")
    if not isinstance(output_dir, str):
        raise _err(path, "output_dir", f"{output_dir!r} must be a path")
    arms_table = data.get("arms")
    if not isinstance(arms_table, dict) or not arms_table:
        raise _err(path, "arms", "missing or empty: add at least one [arms.<name>] table")
    arms = []
    for name, spec in arms_table.items():
        key = f"arms.{name}"
        if not isinstance(spec, dict):
            raise _err(path, key, "must be a table")
        bad = sorted(set(spec) - _ARM_KEYS)
        if bad:
            raise _err(path, f"{key}.{bad[0]}", f"unknown key; an arm has {', '.join(sorted(_ARM_KEYS))}")
        if not name.replace("-", "").replace("_", "").replace("+", "").isalnum():
            raise _err(path, key, "arm names use letters, digits, '-', '_' and '+'")
        arms.append(
            Arm(
                name,
                _paths(path, f"{key}.configs", spec.get("configs", [])),
                _nested(path, f"{key}.set", spec.get("set", {})),
            )
        )
    if only_arms is not None:
        unknown_arms = sorted(set(only_arms) - {a.name for a in arms})
        if unknown_arms:
            raise ConfigError(
                f"--arms: {unknown_arms[0]!r} is not an arm of {path} ({', '.join(a.name for a in arms)})"
            )
        arms = [a for a in arms if a.name in only_arms]
    baseline = data.get("baseline", arms[0].name)
    if only_arms is not None and baseline not in {a.name for a in arms}:
        baseline = arms[0].name
    if baseline not in {a.name for a in arms}:
        raise _err(
            path, "baseline", f"{baseline!r} is not one of the arms ({', '.join(a.name for a in arms)})"
        )
    rl_command = data.get("rl_command", [sys.executable, "-m", "prime_composer.launch.rl"])
    if not isinstance(rl_command, list) or not rl_command or not all(isinstance(c, str) for c in rl_command):
        raise _err(path, "rl_command", f"{rl_command!r} must be a non-empty list of strings")
    share_warmup = data.get("share_warmup", True)
    if not isinstance(share_warmup, bool):
        raise _err(path, "share_warmup", f"{share_warmup!r} must be true or false")
    return AblationConfig(
        path=path,
        base=base,
        output_dir=(Path.cwd() / output_dir).resolve()
        if not Path(output_dir).is_absolute()
        else Path(output_dir),
        seeds=seeds,
        baseline=baseline,
        set=_nested(path, "set", data.get("set", {})),
        arms=arms,
        rl_command=rl_command,
        share_warmup=share_warmup,
    )


# ---- running ------------------------------------------------------------------------------


def run_dir(config: AblationConfig, arm: str, seed: int) -> Path:
    return config.output_dir / "runs" / arm / f"seed{seed}"


def warmup_dir(config: AblationConfig, seed: int) -> Path:
    return config.output_dir / "warmups" / f"seed{seed}"


def _write_generated(
    config: AblationConfig, target: Path, configs: list[Path], sets: dict[str, Any], what: str
) -> Path:
    body = _merge(_merge(config.set, sets), {"launch": {"progress": False, "overwrite": True}})
    body = {"include": [str(p) for p in [*config.base, *configs]], **body}
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(target, f"# Generated by ablate from {config.path} ({what}).\n" + tomli_w.dumps(body))
    return target


def write_run_config(config: AblationConfig, arm: Arm, seed: int, warm_model: Path | None = None) -> Path:
    """The generated rl config of one arm-seed (base, then the arm's configs, then the sets); with
    ``warm_model``, the arm starts from that shared warm-up instead of running its own."""
    sets = _merge(arm.set, {"seed": seed, "output_dir": str(run_dir(config, arm.name, seed))})
    if warm_model is not None:
        sets = _merge(sets, {"model": {"name": str(warm_model)}, "warmup": {"enabled": False}})
    target = config.output_dir / "runs" / arm.name / f"seed{seed}.toml"
    return _write_generated(config, target, arm.configs, sets, f"arm {arm.name}, seed {seed}")


def write_warmup_config(config: AblationConfig, seed: int) -> Path:
    """The generated rl config of the warm-up every arm of ``seed`` shares: ``base`` and the
    top-level ``set`` with ``warmup.only``."""
    sets = {"seed": seed, "output_dir": str(warmup_dir(config, seed)), "warmup": {"only": True}}
    target = config.output_dir / "warmups" / f"seed{seed}.toml"
    return _write_generated(config, target, [], sets, f"the warm-up of seed {seed}")


def _dig(data: dict[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _dry_run(
    config: AblationConfig, toml_path: Path, what: str, run: Callable[..., subprocess.CompletedProcess[str]]
) -> dict[str, Any]:
    proc = run([*config.rl_command, "@", str(toml_path), "--dry-run"], capture_output=True, text=True)
    if proc.returncode != 0:
        detail = " ".join((proc.stderr or proc.stdout).split()).removeprefix("rl: error: ")
        raise ConfigError(
            f"{config.path}: {what}: rl rejects this config: " + (detail or f"exit status {proc.returncode}")
        )
    try:
        resolved: dict[str, Any] = json.loads(proc.stdout[proc.stdout.index("{") :])
    except ValueError:
        raise ConfigError(f"{config.path}: {what}: rl --dry-run printed no config") from None
    return resolved


def _warmup_view(resolved: dict[str, Any]) -> dict[str, Any]:
    """What the SFT warm-up reads of a resolved rl config, by ``WARMUP_KEYS`` (not ``warmup.only``,
    nor the RL learning-rate schedule, which the warm-up replaces with its own constant ``lr``)."""
    view = {key: _dig(resolved, key) for key in WARMUP_KEYS}
    view["warmup"] = {k: v for k, v in (view["warmup"] or {}).items() if k != "only"}
    view["trainer.optim"] = {
        k: v for k, v in (view["trainer.optim"] or {}).items() if k not in _RL_SCHEDULE_KEYS
    }
    return view


def shares_warmup(config: AblationConfig, resolved: dict[str, dict[str, Any]]) -> bool:
    """Whether the arms start from one warm-up per seed: asked for, and the arms warm up at all."""
    return config.share_warmup and bool(_dig(resolved[config.arms[0].name], "warmup.enabled"))


def check_arms(
    config: AblationConfig, run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run
) -> dict[str, dict[str, Any]]:
    """Resolve every arm with ``rl --dry-run``, check they train on the same samples (and, when
    they share a warm-up, that it is the warm-up each would run), and return the resolved configs
    by arm."""
    resolved = {
        arm.name: _dry_run(config, write_run_config(config, arm, config.seeds[0]), f"arms.{arm.name}", run)
        for arm in config.arms
    }
    first = config.arms[0].name
    for arm in config.arms[1:]:
        for key in SAME_SAMPLES_KEYS:
            a, b = _dig(resolved[first], key), _dig(resolved[arm.name], key)
            if a != b:
                raise ConfigError(
                    f"{config.path}: arms.{arm.name}: {key} = {json.dumps(b)} differs from arm {first}'s "
                    f"{json.dumps(a)}; every arm must train on the same samples for the same steps "
                    "(set it in the top-level `set` instead)"
                )
    if shares_warmup(config, resolved):
        warm = _warmup_view(
            _dry_run(config, write_warmup_config(config, config.seeds[0]), "the shared warm-up", run)
        )
        for arm in config.arms:
            mine = _warmup_view(resolved[arm.name])
            for key in WARMUP_KEYS:
                if warm[key] != mine[key]:
                    raise ConfigError(
                        f"{config.path}: arms.{arm.name}: {key} = {json.dumps(mine[key])} differs from the "
                        f"shared warm-up's {json.dumps(warm[key])} (base and the top-level `set`): move the "
                        "setting to the top-level `set`, or set share_warmup = false to give each arm-seed "
                        "its own warm-up"
                    )
    return resolved


def _digests(directory: Path, generated: Path, warm_model: Path | None = None) -> dict[str, str]:
    out = {"config": file_digest(generated)}
    if warm_model is not None:
        out["warmup"] = _model_digest(warm_model)
    for name in METRIC_FILES:
        p = directory / "metrics" / name
        if p.is_file():
            out[name] = file_digest(p)
    return out


def _model_digest(model_dir: Path) -> str:
    """One digest over a model folder's weight files (what a run started from)."""
    return bytes_digest(
        *(f"{p.name}:{file_digest(p)}".encode() for p in sorted(model_dir.glob("*.safetensors")))
    )


def finished_record(
    directory: Path, generated: Path, record_name: str = RUN_RECORD, warm_model: Path | None = None
) -> dict[str, Any] | None:
    """The record of a finished arm-seed (or warm-up) whose files still match their digests, else None."""
    try:
        record = json.loads((directory / record_name).read_text())
        if record.get("digests") == _digests(directory, generated, warm_model):
            return dict(record)
    except (OSError, ValueError):
        return None
    return None


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _last_step(directory: Path) -> int | None:
    records = (
        read_metrics(directory / "metrics" / "trainer.jsonl") if (directory / "metrics").is_dir() else []
    )
    return int(records[-1]["step"]) if records and "step" in records[-1] else None


def _run_rl(
    config: AblationConfig,
    generated: Path,
    directory: Path,
    prefix: str,
    max_steps: int | None,
    poll_s: float,
    echo: Callable[[str], None],
) -> tuple[int, float, Path]:
    """``rl @ generated``, its output in ``generated.log``, a progress line per trainer step it
    logs; returns ``(exit status, wall seconds, log path)``."""
    log_path = generated.with_suffix(".log")
    echo(f"{prefix}: running (log {log_path})")
    start = time.monotonic()
    shown = -1
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [*config.rl_command, "@", str(generated)], stdout=log, stderr=subprocess.STDOUT, text=True
        )
        while True:
            try:
                proc.wait(timeout=poll_s)
                break
            except subprocess.TimeoutExpired:
                step = _last_step(directory)
                if step is not None and step > shown:
                    shown = step
                    echo(f"{prefix}: step {step}/{max_steps or '?'} {time.monotonic() - start:.0f}s")
    return proc.returncode, time.monotonic() - start, log_path


def run_warmup(
    config: AblationConfig, seed: int, label: str, poll_s: float = 5.0, echo: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run (or reuse, when finished and intact) the warm-up every arm of ``seed`` starts from;
    returns its record (``status``, ``model``, ``wall_s``)."""
    directory = warmup_dir(config, seed)
    generated = write_warmup_config(config, seed)
    model = directory / "sft" / "final"
    prefix = f"ablate {label} warm-up seed {seed}"
    done = finished_record(directory, generated, WARMUP_RECORD, model if model.is_dir() else None)
    if done is not None and done.get("status") == "ok":
        echo(f"{prefix}: finished earlier, files match their digests: reused")
        return {**done, "skipped": True}
    code, wall_s, log_path = _run_rl(config, generated, directory, prefix, None, poll_s, echo)
    record: dict[str, Any] = {"seed": seed, "wall_s": wall_s, "model": str(model)}
    if code != 0 or not (model / "config.json").is_file():
        echo(f"{prefix}: FAILED (exit {code}) after {wall_s:.0f}s")
        return {**record, "status": "failed", "returncode": code, "log_tail": _tail(log_path)}
    record = {**record, "status": "ok", "digests": _digests(directory, generated, model)}
    atomic_write_text(directory / WARMUP_RECORD, json.dumps(record, indent=2))
    echo(f"{prefix}: done in {wall_s:.0f}s: {model}")
    return record


def run_one(
    config: AblationConfig,
    arm: Arm,
    seed: int,
    label: str,
    max_steps: int | None,
    poll_s: float = 5.0,
    echo: Callable[[str], None] = print,
    warm_model: Path | None = None,
) -> dict[str, Any]:
    """Run (or skip, when finished and intact) one arm-seed; returns its record. With
    ``warm_model`` the arm starts from that shared warm-up."""
    directory = run_dir(config, arm.name, seed)
    generated = write_run_config(config, arm, seed, warm_model)
    done = finished_record(directory, generated, warm_model=warm_model)
    prefix = f"ablate {label} {arm.name} seed {seed}"
    if done is not None:
        echo(f"{prefix}: finished earlier, files match their digests: skipped")
        return {**done, "skipped": True}
    (directory / FAILED_RECORD).unlink(missing_ok=True)
    code, wall_s, log_path = _run_rl(config, generated, directory, prefix, max_steps, poll_s, echo)
    base: dict[str, Any] = {"arm": arm.name, "seed": seed, "wall_s": wall_s, "run_dir": str(directory)}
    if code != 0:
        return _failed(directory, {**base, "returncode": code, "log_tail": _tail(log_path)}, echo, prefix)
    record: dict[str, Any] = {**base, "status": "ok", **summarize_run(directory)}
    record["teacher_evals"] = evaluate_teachers(config, generated, directory, echo)
    record["digests"] = _digests(directory, generated, warm_model)
    atomic_write_text(directory / RUN_RECORD, json.dumps(record, indent=2))
    echo(
        f"{prefix}: done in {wall_s:.0f}s: reward {_f(record['final_reward'])} "
        f"held-out {_f(record['final_eval'])}"
    )
    return record


def _failed(
    directory: Path, record: dict[str, Any], echo: Callable[[str], None], prefix: str
) -> dict[str, Any]:
    failed = {**record, "status": "failed"}
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_text(directory / FAILED_RECORD, json.dumps(failed, indent=2))
    why = f"exit {record['returncode']}" if record.get("returncode") is not None else record.get("reason", "")
    echo(f"{prefix}: FAILED ({why}) after {record.get('wall_s', 0.0):.0f}s")
    return failed


def local_teacher_models(directory: Path) -> dict[str, Path]:
    """The models of a finished run's local teachers that answer as the policy does (``protocol =
    "agent"``), by teacher name, from the run's resolved teacher config."""
    try:
        teacher = json.loads((directory / "configs" / "teacher.json").read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for entry in teacher.get("pool", []):
        model = directory / "teachers" / str(entry.get("name")) / "sft" / "final"
        if entry.get("local") and entry.get("protocol") == "agent" and (model / "config.json").is_file():
            out[str(entry["name"])] = model
    return out


def evaluate_teachers(
    config: AblationConfig, generated: Path, directory: Path, echo: Callable[[str], None]
) -> dict[str, Any]:
    """Held-out accuracy of each local teacher of a finished run (``eval`` of its model with the
    run's config), cached by the model's digest: teachers trained the same way in two arms are
    evaluated once. A failed eval is recorded with its error, never raised."""
    out: dict[str, Any] = {}
    for name, model in local_teacher_models(directory).items():
        cache = config.output_dir / "teacher-evals" / f"{_model_digest(model)[:16]}"
        summary_path = cache / "summary.json"
        if not summary_path.is_file():
            echo(f"ablate: held-out eval of teacher {name} ({model})")
            proc = subprocess.run(
                [sys.executable, "-m", "prime_composer.eval.main", "@", str(generated),
                 "--checkpoint", str(model), "--results-dir", str(cache)],
                capture_output=True, text=True,
            )  # fmt: skip
            if proc.returncode != 0 or not summary_path.is_file():
                tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-5:])
                out[name] = {"error": f"eval exited {proc.returncode}: {tail}"}
                continue
        overall = json.loads(summary_path.read_text())["overall"]
        out[name] = {"accuracy": overall["accuracy"]["mean"], "n": overall["n"]}
    return out


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def summarize_run(directory: Path) -> dict[str, Any]:
    """Curves and final values of one finished run, from its metrics files."""
    orch = read_metrics(directory / "metrics" / "orchestrator.jsonl")
    teacher = read_metrics(directory / "metrics" / "teacher.jsonl")
    reward = {int(r["step"]): float(r["reward/mean"]) for r in orch if r.get("reward/mean") is not None}
    evals = {int(r["step"]): float(r["eval/accuracy"]) for r in orch if r.get("eval/accuracy") is not None}
    spend = [float(r["teacher/spent_usd"]) for r in teacher if r.get("teacher/spent_usd") is not None]
    return {
        "reward_curve": {str(k): v for k, v in sorted(reward.items())},
        "eval_curve": {str(k): v for k, v in sorted(evals.items())},
        "final_reward": reward[max(reward)] if reward else None,
        "initial_eval": evals[min(evals)] if evals else None,
        "final_eval": evals[max(evals)] if evals else None,
        "teacher_usd": max(spend) if spend else 0.0,
    }


# ---- the summary --------------------------------------------------------------------------


def _values(runs: list[dict[str, Any]], key: str) -> dict[int, float]:
    return {r["seed"]: r[key] for r in runs if r.get("status") == "ok" and r.get(key) is not None}


def _teacher_accuracy(run: dict[str, Any]) -> float | None:
    """The mean held-out accuracy of a run's evaluated local teachers (None without any)."""
    accs = [t["accuracy"] for t in (run.get("teacher_evals") or {}).values() if "accuracy" in t]
    return sum(accs) / len(accs) if accs else None


def summarize(config: AblationConfig, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: means and t-intervals over seeds, paired differences against the baseline."""
    by_arm = {arm.name: [r for r in records if r["arm"] == arm.name] for arm in config.arms}
    arms: dict[str, Any] = {}
    for name, runs in by_arm.items():
        ok = [r for r in runs if r.get("status") == "ok"]
        entry: dict[str, Any] = {
            "seeds_ok": sorted(r["seed"] for r in ok),
            "seeds_failed": sorted(r["seed"] for r in runs if r.get("status") != "ok"),
            "wall_s": sum(r.get("wall_s", 0.0) for r in ok),
            "teacher_usd": sum(r.get("teacher_usd", 0.0) for r in ok),
        }
        for key in ("final_reward", "initial_eval", "final_eval"):
            entry[key] = t_interval(list(_values(runs, key).values())).as_dict()
        entry["teacher_eval"] = t_interval(
            [acc for r in ok if (acc := _teacher_accuracy(r)) is not None]
        ).as_dict()
        entry["eval_gain"] = t_interval(
            [
                r["final_eval"] - r["initial_eval"]
                for r in ok
                if r.get("final_eval") is not None and r.get("initial_eval") is not None
            ]
        ).as_dict()
        if name != config.baseline:
            base_runs = by_arm[config.baseline]
            entry["vs_baseline"] = {
                key: paired_difference(_values(runs, key), _values(base_runs, key)).as_dict()
                for key in ("final_reward", "final_eval")
            }
        arms[name] = entry
    return {"baseline": config.baseline, "seeds": config.seeds, "arms": arms}


def _iv(d: dict[str, Any], signed: bool = False) -> str:
    iv = TInterval(**d)
    if iv.mean is None:
        return "-"
    fmt = "+.3f" if signed else ".3f"
    if iv.ci_low is None or iv.ci_high is None:
        return f"{iv.mean:{fmt}} (n={iv.n})"
    return f"{iv.mean:{fmt}} [{iv.ci_low:{fmt}}, {iv.ci_high:{fmt}}]"


def render_markdown(
    config: AblationConfig,
    summary: dict[str, Any],
    records: list[dict[str, Any]],
    warmups: list[dict[str, Any]] | None = None,
) -> str:
    lines = [
        f"# Ablation: {config.path.name}",
        "",
        f"Seeds {', '.join(map(str, config.seeds))}; means over seeds with 95% Student-t intervals; "
        f"paired differences against `{config.baseline}` over the seeds both finished.",
    ]
    if warmups:
        lines += [
            "",
            "Every arm of a seed starts from the same warm-up (wall s, not in the arms' wall): "
            + ", ".join(
                f"seed {w['seed']} {w.get('wall_s', 0.0):.0f}"
                + ("" if w.get("status") == "ok" else " FAILED")
                for w in warmups
            )
            + ".",
        ]
    lines += [
        "",
        "| arm | seeds ok | final train reward | held-out at start | final held-out | held-out gain "
        "| reward vs base | held-out vs base | teacher held-out | wall s | teacher $ |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, a in summary["arms"].items():
        vs = a.get("vs_baseline")
        lines.append(
            f"| {name} | {len(a['seeds_ok'])}/{len(a['seeds_ok']) + len(a['seeds_failed'])} "
            f"| {_iv(a['final_reward'])} | {_iv(a['initial_eval'])} | {_iv(a['final_eval'])} "
            f"| {_iv(a['eval_gain'], True)} "
            f"| {_iv(vs['final_reward'], True) if vs else '(baseline)'} "
            f"| {_iv(vs['final_eval'], True) if vs else '(baseline)'} "
            f"| {_iv(a['teacher_eval'])} | {a['wall_s']:.0f} | {a['teacher_usd']:.4f} |"
        )
    failed = [r for r in records if r.get("status") != "ok"]
    lines += [
        "",
        "## Runs",
        "",
        "| arm | seed | status | final reward | final held-out | wall s |",
        "|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['arm']} | {r['seed']} | {r.get('status')} | {_f(r.get('final_reward'))} "
            f"| {_f(r.get('final_eval'))} | {r.get('wall_s', 0.0):.0f} |"
        )
    if failed:
        lines += ["", "## Failed runs", ""]
        for r in failed:
            why = r.get("reason") or f"exit status {r.get('returncode')}"
            lines += [
                f"- **{r['arm']} seed {r['seed']}**: {why}; log tail:",
                "",
                "```",
                r.get("log_tail", ""),
                "```",
            ]
    lines += ["", "![curves](ablation.png)", ""]
    return "\n".join(lines)


def _band(curves: list[dict[str, float]]) -> tuple[list[int], list[float], list[float], list[float]]:
    steps = sorted({int(s) for c in curves for s in c})
    xs, means, lows, highs = [], [], [], []
    for s in steps:
        iv = t_interval([c[str(s)] for c in curves if str(s) in c])
        if iv.mean is None:
            continue
        xs.append(s)
        means.append(iv.mean)
        lows.append(iv.ci_low if iv.ci_low is not None else iv.mean)
        highs.append(iv.ci_high if iv.ci_high is not None else iv.mean)
    return xs, means, lows, highs


def _curve(run: dict[str, Any], key: str) -> dict[str, float]:
    """A run's curve by step; ``eval_gain``: its held-out curve minus its first eval (the seeds'
    warm-ups differ far more than the arms do, and this takes that spread out of the band)."""
    if key != "eval_gain":
        return dict(run[key])
    curve = run["eval_curve"]
    if not curve:
        return {}
    start = curve[min(curve, key=int)]
    return {s: v - start for s, v in curve.items()}


def write_figure(config: AblationConfig, records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 4))
    for ax, key, title in (
        (axes[0], "reward_curve", "train reward (mean over seeds, 95% t band)"),
        (axes[1], "eval_curve", "held-out accuracy (mean over seeds, 95% t band)"),
        (axes[2], "eval_gain", "held-out accuracy minus its start, per seed (mean, 95% t band)"),
    ):
        for arm in config.arms:
            curves = [_curve(r, key) for r in records if r["arm"] == arm.name and r.get("status") == "ok"]
            xs, means, lows, highs = _band(curves)
            if not xs:
                continue
            (line,) = ax.plot(xs, means, marker="o", markersize=2, label=f"{arm.name} (n={len(curves)})")
            ax.fill_between(xs, lows, highs, color=line.get_color(), alpha=0.2)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())


def write_outputs(
    config: AblationConfig, records: list[dict[str, Any]], warmups: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    summary = summarize(config, records)
    warmups = [{k: v for k, v in w.items() if k != "digests"} for w in warmups or []]
    config.output_dir.mkdir(parents=True, exist_ok=True)
    public = [{k: v for k, v in r.items() if k != "digests"} for r in records]
    atomic_write_text(
        config.output_dir / "ablation.json",
        json.dumps(
            {"config": str(config.path), "summary": summary, "runs": public, "warmups": warmups}, indent=2
        ),
    )
    atomic_write_text(config.output_dir / "ablation.md", render_markdown(config, summary, records, warmups))
    write_figure(config, records, config.output_dir / "ablation.png")
    return summary


def run_ablation(
    config: AblationConfig, echo: Callable[[str], None] = print, poll_s: float = 5.0
) -> dict[str, Any]:
    resolved = check_arms(config)
    resolved_steps = _dig(resolved[config.arms[0].name], "max_steps")
    total = len(config.arms) * len(config.seeds)
    records = []
    start = time.monotonic()
    i = 0
    shared = shares_warmup(config, resolved)
    warmups = []
    for seed in config.seeds:  # seed-major: an interrupted ablation still has every arm's early seeds
        warm_model = None
        if shared:
            warmups.append(run_warmup(config, seed, f"[seed {seed}]", poll_s, echo))
            if warmups[-1]["status"] != "ok":
                for arm in config.arms:  # every arm of the seed fails with it, and says why
                    i += 1
                    directory = run_dir(config, arm.name, seed)
                    failed = {"arm": arm.name, "seed": seed, "wall_s": 0.0, "run_dir": str(directory),
                              "reason": "its shared warm-up failed", "log_tail": warmups[-1]["log_tail"]}  # fmt: skip
                    records.append(
                        _failed(directory, failed, echo, f"ablate [{i}/{total}] {arm.name} seed {seed}")
                    )
                continue
            warm_model = Path(warmups[-1]["model"])
        for arm in config.arms:
            i += 1
            records.append(
                run_one(config, arm, seed, f"[{i}/{total}]", resolved_steps, poll_s, echo, warm_model)
            )
    summary = write_outputs(config, records, warmups)
    failed = sum(r.get("status") != "ok" for r in records)
    echo(
        f"ablate: {total - failed}/{total} arm-seeds finished ({failed} failed) in {time.monotonic() - start:.0f}s; "
        f"table {config.output_dir / 'ablation.md'}"
    )
    return summary


def _parse_argv(argv: Sequence[str]) -> tuple[Path, dict[str, Any], bool]:
    usage = "usage: ablate @ ablation.toml [--output_dir DIR] [--seeds 0,1,2] [--arms a,b] [--dry-run]"
    args = list(argv)
    if len(args) < 2 or args[0] != "@":
        raise ConfigError(usage)
    path = Path(args[1])
    overrides: dict[str, Any] = {}
    dry = False
    rest = args[2:]
    while rest:
        flag = rest.pop(0)
        if flag == "--dry-run":
            dry = True
        elif flag in ("--output_dir", "--seeds", "--arms") and rest:
            value = rest.pop(0)
            if flag == "--arms":
                overrides["only_arms"] = value.split(",")
            elif flag == "--seeds":
                try:
                    overrides["seeds"] = [int(s) for s in value.split(",")]
                except ValueError:
                    raise ConfigError(f"--seeds {value!r}: give integers separated by commas") from None
            else:
                overrides["output_dir"] = value
        else:
            raise ConfigError(f"{flag}: unknown or incomplete argument; {usage}")
    return path, overrides, dry


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print((__doc__ or "").strip())
        return 0
    try:
        path, overrides, dry = _parse_argv(argv)
        config = load_config(path, overrides)
        if dry:
            check_arms(config)
            print(
                f"ablate: {len(config.arms)} arms x {len(config.seeds)} seeds resolve and train on the same samples"
            )
            return 0
        summary = run_ablation(config)
    except ConfigError as e:
        print(f"ablate: {e}", file=sys.stderr)
        return 2
    failed = sum(len(a["seeds_failed"]) for a in summary["arms"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

"""``eval``: evaluate a checkpoint on the eval split of the run's environments, on its own.

    uv run eval @ configs/quickstart.toml --checkpoint outputs/quickstart/final
    uv run eval @ configs/quickstart.toml --checkpoint outputs/quickstart/checkpoints/step_60
    uv run eval @ configs/quickstart.toml --checkpoint outputs/quickstart/broadcasts/step_40 \\
        --num-samples 8 --temperature 1.0

It reads the run's own config (so the model, environments and inference settings are the ones
the run used), turns the checkpoint into a model directory when it is not one (a trainer
checkpoint's DCP shards are loaded into the base model's architecture; a published weights
directory gets the base model's tokenizer: ``trainer/export.py``), serves it with the inference
server of ``[inference]`` (the embedded ``hf`` server in this process, or vLLM as a child process),
and plays every task of each environment's eval split (``eval_args``) ``num_samples`` times with
the orchestrator's own environment loading and rollout runner.

It prints, per environment and overall, n, the accuracy with its 95% confidence interval (Wilson
for one sample per task, normal over tasks for several: ``stats.py``), the mean reward, and
pass@1..pass@k; and writes ``<results_dir>/results.jsonl`` (one line per task: rewards, errors,
completions) and ``summary.json``. A failed rollout counts as wrong and is listed with its error.
Evaluating an export (``<output_dir>/final``) adds the results to its model card.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prime_composer.config.base import ModelConfig
from prime_composer.config.errors import ConfigError
from prime_composer.config.evaluate import EvalRunConfig, resolve_kwargs
from prime_composer.config.inference import InferenceConfig
from prime_composer.health import wait_healthy
from prime_composer.netaddr import client_url

logger = logging.getLogger(__name__)

MAX_COMPLETION_CHARS = 2000
"""Longest completion text kept per sample in ``results.jsonl``."""


def default_results_dir(config: EvalRunConfig) -> Path:
    """``<output_dir>/eval/<name>``: ``final``, ``checkpoints-step_20``, ``broadcasts-step_20``, ``base``."""
    if config.results_dir is not None:
        return config.results_dir
    if config.checkpoint is None:
        return config.output_dir / "eval" / "base"
    path = config.checkpoint.resolve()
    if path.name == "trainer":
        path = path.parent
    name = f"{path.parent.name}-{path.name}" if path.name.startswith("step_") else path.name
    return config.output_dir / "eval" / name


def model_directory(config: EvalRunConfig, results_dir: Path) -> str:
    """The model to serve: ``model.name`` without a checkpoint, else a directory for the checkpoint."""
    if config.checkpoint is None:
        return config.model.name
    from prime_composer.trainer.export import to_hf_directory

    try:
        return str(to_hf_directory(config.checkpoint, config.model, results_dir / "model"))
    except ValueError as e:
        raise ConfigError(f"--checkpoint {config.checkpoint}: {e}") from None


def served_model(config: EvalRunConfig, model: str) -> ModelConfig:
    """The run's model config, named ``model``. Its GGUF file belongs to the base model only: a
    checkpoint's folder (an export, a warm-up) holds safetensors, however the run's model was
    loaded."""
    gguf_file = config.model.gguf_file if model == config.model.name else None
    return config.model.model_copy(update={"name": model, "gguf_file": gguf_file})


@contextlib.contextmanager
def serving(inference: InferenceConfig, log_path: Path, gpus: list[int] | None = None) -> Iterator[str]:
    """An inference server for ``inference``; yields its OpenAI base URL (``.../v1``). Inside this
    process when the backend can (``hf``), else ``uv run inference`` as a child that sees only
    ``gpus`` (the run's ``launch.gpus.inference``) when given."""
    from prime_composer.inference.backend import get_backend

    backend = get_backend(inference.backend)
    try:
        backend.check(inference)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    here = backend.in_process(inference)
    if here is not None:
        with here as url:
            yield f"{url}/v1"
        return
    from prime_composer.launch.process import ManagedProcess, ProcessSpec

    config_path = log_path.parent / "inference.json"
    config_path.write_text(json.dumps(inference.model_dump(mode="json"), indent=2))
    url = client_url(inference.host, inference.port)
    process = ManagedProcess(
        ProcessSpec(
            name="inference",
            argv=[sys.executable, "-m", "prime_composer.inference.main", "@", str(config_path)],
            kind="service",
            env={"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))} if gpus else {},
        ),
        log_path,
    )
    process.start()
    try:
        waited = wait_healthy(
            f"{url}/health",
            inference.vllm.startup_timeout_s,
            give_up=lambda: None if process.poll() is None else "exited",
        )
        if not waited.healthy:
            raise RuntimeError(
                f"the inference server did not come up; its log ({log_path}):\n{process.tail()}"
            )
        yield f"{url}/v1"
    finally:
        process.stop(30.0)


async def play(config: EvalRunConfig, base_url: str, model: str, tokenizer: Any) -> list[dict[str, Any]]:
    """One record per eval task of every environment with ``eval_args``."""
    from prime_composer.orchestrator.envs import load_envs
    from prime_composer.orchestrator.rollout import API_KEY_VAR, RolloutRunner

    orch = config.orchestrator
    try:
        envs = [e for e in load_envs(orch.env, orch.rollout) if e.eval_taskset is not None]
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not envs:
        raise ConfigError(
            "no orchestrator.env entry has eval_args, so there is no eval split to run: set eval_args "
            "(e.g. {split = 'eval'}) on the environments to evaluate"
        )
    sampling = orch.sampling.model_copy(update={"temperature": config.sampling_temperature()})
    async with RolloutRunner(
        envs,
        base_url=base_url,
        model=model,
        sampling=sampling,
        rollout=orch.rollout,
        api_key_var=config.inference.secret_env or API_KEY_VAR,
    ) as runner:
        jobs = []
        for loaded in envs:
            tasks = loaded.tasks("eval")
            if config.num_examples is not None:
                tasks = tasks[: config.num_examples]
            for i, task in enumerate(tasks):
                jobs.append((loaded.label, i, task, loaded))
        groups = await asyncio.gather(
            *(
                runner.run_group(
                    loaded, task, group_size=config.num_samples, example_id=i, group_id=-1 - n,
                    policy_step=0, sampling=sampling,
                )
                for n, (_, i, task, loaded) in enumerate(jobs)
            )
        )  # fmt: skip
    records = []
    for (label, i, task, _), samples in zip(jobs, groups, strict=True):
        rewards = [s.reward for s in samples]
        records.append(
            {
                "env": label,
                "task_index": i,
                "task_id": getattr(task.data, "id", None),
                "rewards": rewards,
                "num_correct": sum(
                    1 for s in samples if s.error is None and s.reward >= config.success_threshold
                ),
                "errors": [s.error for s in samples if s.error is not None],
                "completions": [
                    tokenizer.decode(s.completion_ids, skip_special_tokens=True)[:MAX_COMPLETION_CHARS]
                    for s in samples
                ],
            }
        )
    return records


def summarize_records(records: list[dict[str, Any]], config: EvalRunConfig) -> dict[str, Any]:
    from statistics import fmean

    from prime_composer.eval.stats import summarize

    def stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
        # A group with failed rollouts has fewer samples: pad with wrong ones (reward 0) so every
        # task counts num_samples draws, as the error already counts as a miss.
        k = config.num_samples
        tasks = [
            (k, r["num_correct"], fmean([*r["rewards"], *[0.0] * (k - len(r["rewards"]))])) for r in rows
        ]
        return {**summarize(tasks), "num_errors": sum(len(r["errors"]) for r in rows)}

    labels = list(dict.fromkeys(r["env"] for r in records))
    return {
        "checkpoint": str(config.checkpoint) if config.checkpoint is not None else None,
        "model": config.model.name,
        "num_samples": config.num_samples,
        "temperature": config.sampling_temperature(),
        "success_threshold": config.success_threshold,
        "envs": {label: stats([r for r in records if r["env"] == label]) for label in labels},
        "overall": stats(records),
    }


def format_summary(summary: dict[str, Any]) -> str:
    lines = [
        f"eval: {summary['checkpoint'] or summary['model']}: {summary['num_samples']} sample(s) per task, "
        f"temperature {summary['temperature']}"
    ]
    for label, s in {**summary["envs"], "all": summary["overall"]}.items():
        acc, reward = s["accuracy"], s["reward"]
        passes = " ".join(f"pass@{k}={v:.4f}" for k, v in s["pass_at_k"].items())
        lines.append(
            f"  {label}: n={s['n']} accuracy={acc['mean']:.4f} 95% CI [{acc['ci_low']:.4f}, "
            f"{acc['ci_high']:.4f}] ({acc['method']}) reward={reward['mean']:.4f} {passes}"
            + (f" errors={s['num_errors']}" if s["num_errors"] else "")
        )
    return "\n".join(lines)


def run(config: EvalRunConfig) -> int:
    from prime_composer.io import atomic_write_text
    from prime_composer.logs import setup_logging

    setup_logging("eval")
    results_dir = default_results_dir(config)
    results_dir.mkdir(parents=True, exist_ok=True)
    served = served_model(config, model_directory(config, results_dir))
    inference = config.inference.model_copy(update={"model": served, "served_model_name": None})
    from prime_composer.model.resolve import load_tokenizer

    model = served.name
    tokenizer = load_tokenizer(model, gguf_file=served.gguf_file)
    with serving(inference, results_dir / "inference.log", config.launch.gpus.get("inference")) as base_url:
        records = asyncio.run(play(config, base_url, model, tokenizer))
    summary = summarize_records(records, config)
    atomic_write_text(results_dir / "results.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    atomic_write_text(results_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    print(format_summary(summary), flush=True)
    print(f"eval: results in {results_dir} (results.jsonl, summary.json)", flush=True)
    if config.checkpoint is not None and (config.checkpoint / "README.md").is_file():
        from prime_composer.trainer.model_card import write_model_card

        if write_model_card(config.checkpoint, config.output_dir) is not None:
            print(f"eval: added the results to the model card {config.checkpoint / 'README.md'}")
    return 0


def main() -> None:
    from prime_composer.config.cli import exit_process, run_entry_point

    exit_process(
        run_entry_point(
            EvalRunConfig,
            run,
            prog="eval",
            describe="Evaluate a checkpoint on the environments' eval splits (accuracy, 95% CI, pass@k).",
            **resolve_kwargs(EvalRunConfig),
        )
    )


if __name__ == "__main__":
    main()

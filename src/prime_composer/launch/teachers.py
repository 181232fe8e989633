"""Teachers that ``rl`` serves itself (``[teacher.pool.local]``): their warm-up and their servers.

A pool entry with ``local`` set is a model this machine serves, the way a PRIME-RL user would run
``uv run inference`` for it by hand, with the plumbing done here:

1. **warm-up** (jobs, before the run): the run's warm-up chats (``warmup.data``,
   or the ones the student's warm-up generated, or generated now) are the data of a teacher of
   ``protocol = "agent"``; for ``review`` teachers they are rendered as the service's review
   prompts (``teacher/sft_data.py``, log ``logs/teacher-data.log``). Then ``sft`` fine-tunes
   each teacher with ``warmup_steps > 0`` on them, all teachers side by side
   (``<output_dir>/teachers/<name>/``, log ``logs/teacher-<name>-sft.log``). A resumed run keeps
   the teachers that finished;
2. **servers** (services, started before the teacher service): ``prime_composer.inference.main``
   on a free loopback port with ``configs/teacher-<name>-inference.json``, under ``nice -n
   <teacher.nice>`` when that is set (the service lowers its own priority the same way); the
   launcher waits for
   each ``/health``, and the endpoint's ``base_url`` is filled in before ``configs/teacher.json`` is
   written, so the service calls it like any other teacher.

Everything stops with the run (the launcher stops services in reverse start order).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from prime_composer.config.base import CheckpointConfig, ModelConfig
from prime_composer.config.inference import InferenceConfig
from prime_composer.config.ports import free_port
from prime_composer.config.rl import RLConfig
from prime_composer.config.sft import SFTConfig
from prime_composer.config.teacher import TeacherEndpointConfig
from prime_composer.io import atomic_write_text
from prime_composer.launch.process import ProcessSpec


def local_teachers(config: RLConfig) -> list[TeacherEndpointConfig]:
    """The pool entries ``rl`` serves itself, in pool order."""
    if config.teacher is None:
        return []
    return [e for e in config.teacher.pool if e.local is not None]


def slug(endpoint: TeacherEndpointConfig) -> str:
    """The teacher's name as it appears in file and process names."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", endpoint.id)


def teacher_dir(config: RLConfig, endpoint: TeacherEndpointConfig) -> Path:
    return config.output_dir / "teachers" / slug(endpoint)


def start_model(config: RLConfig, endpoint: TeacherEndpointConfig) -> ModelConfig:
    """What the teacher starts from: ``local.model``, or with ``local.from_policy`` the policy's
    model as the run starts it (``config.model``, the warm-up's result once ``rl`` has run it)."""
    assert endpoint.local is not None
    return config.model if endpoint.local.from_policy else endpoint.local.model


def served_model(config: RLConfig, endpoint: TeacherEndpointConfig) -> ModelConfig:
    """What the teacher's server loads: its fine-tuned copy, or its start model as it is."""
    assert endpoint.local is not None
    start = start_model(config, endpoint)
    if endpoint.local.warmup_steps == 0:
        return start
    return ModelConfig(name=str(teacher_dir(config, endpoint) / "sft" / "final"), dtype=start.dtype)


def warmup_specs(
    config: RLConfig, teacher_config: Path, resuming: bool
) -> tuple[list[ProcessSpec], list[ProcessSpec]]:
    """The jobs that fine-tune the local teachers still to be fine-tuned: ``(data jobs, to run one
    after the other; SFT jobs, one per teacher, that can run side by side)``."""
    todo = [
        e
        for e in local_teachers(config)
        if e.local is not None
        and e.local.warmup_steps > 0
        and not (resuming and (teacher_dir(config, e) / "sft" / "final" / "config.json").exists())
    ]
    if not todo:
        return [], []
    python = sys.executable
    root = config.output_dir / "teachers"
    specs, sft_specs = [], []
    chats = config.warmup.data
    if chats is None and config.warmup.enabled:
        chats = config.output_dir / "sft" / "data.jsonl"  # written by the student's warm-up
    if chats is None:
        chats = root / "chats.jsonl"
        specs.append(
            ProcessSpec(
                name="teacher-chats",
                argv=[
                    python, "-m", "prime_composer.orchestrator.sft_export",
                    "--config", str(config.output_dir / "configs" / "orchestrator.json"),
                    "--out", str(chats),
                    "--num-examples", str(config.warmup.num_examples),
                ],
                kind="job",
            )
        )  # fmt: skip
    review_data = root / "data.jsonl"  # the chats as review prompts answered in JSON
    if any(e.protocol == "review" for e in todo):
        specs.append(
            ProcessSpec(
                name="teacher-data",
                argv=[
                    python, "-m", "prime_composer.teacher.sft_data",
                    "--config", str(teacher_config), "--data", str(chats), "--out", str(review_data),
                ],
                kind="job",
            )
        )  # fmt: skip
    for endpoint in todo:
        local = endpoint.local
        assert local is not None
        sft = SFTConfig(
            model=start_model(config, endpoint),
            output_dir=teacher_dir(config, endpoint),
            data=chats if endpoint.protocol == "agent" else review_data,
            max_steps=local.warmup_steps,
            batch_size=local.warmup_batch_size,
            micro_batch_size=local.warmup_batch_size,
            seq_len=local.seq_len,
            label_smoothing=local.warmup_label_smoothing,
            seed=local.seed,
            num_threads=local.num_threads,
            log_every=50,
            ckpt=CheckpointConfig(at_end=False),
            optim=config.trainer.optim.model_copy(
                update={"lr": local.warmup_lr, "warmup_steps": 0, "schedule": "constant"}
            ),
        )
        path = config.output_dir / "configs" / f"teacher-{slug(endpoint)}-sft.json"
        atomic_write_text(path, json.dumps(sft.model_dump(mode="json"), indent=2) + "\n")
        sft_specs.append(
            ProcessSpec(
                name=f"teacher-{slug(endpoint)}-sft",
                argv=[python, "-m", "prime_composer.trainer.sft", "@", str(path)],
                kind="job",
            )
        )
    return specs, sft_specs


def server_specs(config: RLConfig) -> list[ProcessSpec]:
    """One inference server per local teacher; fills in each endpoint's ``base_url`` (so write the
    resolved configs after this)."""
    specs = []
    taken = {config.inference.port, *([config.teacher.port] if config.teacher is not None else [])}
    for endpoint in local_teachers(config):
        local = endpoint.local
        assert local is not None
        port = free_port("127.0.0.1", taken)
        inference = InferenceConfig(
            model=served_model(config, endpoint),
            output_dir=teacher_dir(config, endpoint),  # weight updates: none (the teacher is frozen)
            seed=config.seed,
            port=port,
            served_model_name=endpoint.model,
            max_model_len=local.seq_len,
            device=local.device,
            num_threads=local.num_threads,
        )
        path = config.output_dir / "configs" / f"teacher-{slug(endpoint)}-inference.json"
        atomic_write_text(path, json.dumps(inference.model_dump(mode="json"), indent=2) + "\n")
        endpoint.base_url = f"http://127.0.0.1:{port}/v1"
        specs.append(
            ProcessSpec(
                name=f"teacher-{slug(endpoint)}",
                argv=[*_niced(config), sys.executable, "-m", "prime_composer.inference.main", "@", str(path)],
                kind="service",
                health_url=f"http://127.0.0.1:{port}/health",
            )
        )
    return specs


def _niced(config: RLConfig) -> list[str]:
    """The prefix that starts a local teacher's server at ``teacher.nice`` (``nice`` execs the
    server, so the launcher's process is the server itself)."""
    nice = config.teacher.nice if config.teacher is not None else 0
    return ["nice", "-n", str(nice)] if nice else []

"""The table of PRIME-RL's config keys: what each becomes in this project (``prime_rl/names.py``
applies it; ``docs/prime-rl.md`` is the same table for readers).

Four kinds: ``rename`` (the same setting under our name), ``same`` (what this project always does:
nothing to set), ``ignored`` (only where or how fast the run goes: dropped with a note) and
``unsupported`` (would change what is trained: an error). The first rule that matches a key applies,
so specific keys come before the ``.*`` rule of their section.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["rename", "same", "ignored", "unsupported"]

SEATS = ("agent", "player")
"""Names PRIME-RL's verifiers environments give their agent seats (``env.<seat>.harness``)."""


@dataclass(frozen=True)
class Rule:
    """What one PRIME-RL key becomes. A key ending in ``.*`` matches itself and everything under it."""

    key: str
    kind: Kind
    ours: str = ""
    """``rename``: our key (a ``.*`` key maps its children one for one); otherwise what to use instead."""
    why: str = ""
    convert: Callable[[Any], Any] | None = None
    """``rename``: turns PRIME-RL's value into ours."""
    when: Callable[[Any], bool] | None = None
    """``same``: only for values that mean what we do; any other value is ``otherwise``."""
    otherwise: Kind = "unsupported"

    def matches(self, dotted: str) -> bool:
        if self.key.endswith(".*"):
            stem = self.key[:-2]
            return dotted == stem or dotted.startswith(stem + ".")
        return dotted == self.key


def rename(key: str, ours: str, convert: Callable[[Any], Any] | None = None, why: str = "") -> Rule:
    return Rule(key, "rename", ours=ours, convert=convert, why=why)


def same(
    key: str,
    why: str,
    when: Callable[[Any], bool] | None = None,
    *,
    otherwise: Kind = "unsupported",
    instead: str = "",
) -> Rule:
    return Rule(key, "same", ours=instead, why=why, when=when, otherwise=otherwise)


def ignored(key: str, why: str, instead: str = "") -> Rule:
    return Rule(key, "ignored", ours=instead, why=why)


def unsupported(key: str, why: str, instead: str) -> Rule:
    return Rule(key, "unsupported", ours=instead, why=why)


def _per_process(make: Callable[[str], list[Rule]]) -> list[Rule]:
    """The same rules at the top level and inside ``[trainer]`` / ``[orchestrator]`` (split files)."""
    return [rule for prefix in ("", "trainer.", "orchestrator.") for rule in make(prefix)]


def _wandb_mode(offline: Any) -> str:
    """PRIME-RL's ``offline = true`` (or ``--wandb.offline true``) is ``mode = "offline"``; false is
    the default, online when the server can be reached."""
    return "offline" if offline in (True, "true", "True") else "auto"


_LOG = "PRIME_COMPOSER_LOG_LEVEL=debug in the environment"
REPLICAS_WHY = (
    "each data-parallel engine is its own server (a replica) here; the orchestrator spreads "
    "rollouts over them and updates them all"
)
VLLM_DP_WHY = "vLLM's data parallelism, as in PRIME-RL: one server with that many engines"
_ONE_API_SERVER = (
    "each server has one API process, which spreads requests over its data-parallel engines "
    "(the admin routes keep the served step in it)"
)
_LORA_SERVED = "the adapter is served under the model's own name (inference.served_model_name)"
_LORA_VLLM = "rl starts vLLM with --enable-lora --max-lora-rank trainer.model.lora.rank when LoRA is on"
_NO_LENGTH_PENALTY = (
    "rewards get no length penalty here (orchestrator.advantage.overlong_buffer is DAPO's soft "
    "overlong penalty, a different rule)"
)


def _shared_rules(p: str) -> list[Rule]:
    return [
        rename(f"{p}ckpt.keep_last", f"{p}ckpt.keep"),
        ignored(f"{p}ckpt.keep_interval", "checkpoints are only kept by recency", f"{p}ckpt.keep"),
        ignored(f"{p}ckpt.output_dir", "checkpoints live under <output_dir>/checkpoints", "output_dir"),
        ignored(f"{p}ckpt.skip_progress", "a checkpoint always holds every part of the state"),
        ignored(f"{p}ckpt.skip_scheduler", "a checkpoint always holds every part of the state"),
        ignored(f"{p}ckpt.skip_dataloader", "a checkpoint always holds every part of the state"),
        ignored(f"{p}ckpt.skip_optimizer", "a checkpoint always holds every part of the state"),
        ignored(
            f"{p}ckpt.wait_for_weights_timeout",
            "checkpoints never wait for weights",
            "orchestrator.weights_timeout_s",
        ),
        rename(f"{p}resume.step", "ckpt.resume_step"),
        rename(f"{p}resume", "ckpt.resume", convert=lambda _: True),
        unsupported(
            f"{p}resume.dir",
            "a run resumes only from its own checkpoints",
            "copy that checkpoints/step_N into this run's output_dir and set ckpt.resume_step = N",
        ),
        rename(f"{p}monitors.wandb.offline", "wandb.mode", convert=_wandb_mode),
        ignored(f"{p}monitors.wandb.log_extras.*", "samples and distributions are not logged to W&B"),
        rename(f"{p}monitors.wandb.*", "wandb.*"),
        same(f"{p}monitors.file.*", "metrics are always written to <output_dir>/metrics/<process>.jsonl"),
        ignored(f"{p}monitors.prime.*", "there is no Prime platform monitor"),
        ignored(f"{p}log.*", "log levels are not part of the config", _LOG),
        ignored(
            f"{p}env_vars.*",
            "processes inherit the environment of `rl`",
            "export them before `uv run rl` (inference.vllm.env for the vLLM server alone)",
        ),
        ignored(f"{p}heartbeat.*", "there is no heartbeat monitor"),
        ignored(f"{p}metrics_server.*", "there is no metrics server; metrics are in metrics/<process>.jsonl"),
        same(
            f"{p}weight_broadcast.type",
            "weights are published through the filesystem (broadcasts/step_N)",
            lambda v: v == "filesystem",
            otherwise="ignored",
        ),
        ignored(f"{p}weight_broadcast.*", "weights are published through the filesystem (broadcasts/step_N)"),
        rename(f"{p}rollout_transport.type", "transport.kind"),
        rename(f"{p}rollout_transport.host", "transport.host"),
        rename(f"{p}rollout_transport.port", "transport.port"),
        ignored(f"{p}rollout_transport.hwm", "the zmq transport serves one step at a time"),
        rename(f"{p}tokenizer.trust_remote_code", "model.trust_remote_code"),
        unsupported(
            f"{p}tokenizer.*",
            "the tokenizer and chat template are always the model's",
            "save a model directory with the tokenizer you want and use it as model.name",
        ),
    ]


RULES: tuple[Rule, ...] = (
    *_per_process(_shared_rules),
    # ---- top level
    rename("seq_len", "orchestrator.seq_len"),
    rename("clean", "launch.overwrite"),
    rename("wandb.offline", "wandb.mode", convert=_wandb_mode),
    ignored("wandb.log_extras.*", "samples and distributions are not logged to W&B"),
    ignored("dry_run", "not a config key here", "the --dry-run flag"),
    unsupported("model.vlm.*", "only text models are trained", "remove it"),
    ignored(
        "slurm.*",
        "rl does not submit jobs",
        "sbatch infra/multinode/slurm.sbatch (rl on every node of the allocation)",
    ),
    rename("deployment.num_train_gpus", "trainer.num_ranks"),
    # deployment.type, num_train_nodes, num_infer_nodes, nodes_per_fsdp_group, (multi_node)
    # gpus_per_node and (single_node) num_infer_gpus: names.py
    ignored(
        "deployment.num_infer_replicas",
        "the servers of the inference nodes are started there and listed here",
        "orchestrator.base_url, one URL per replica",
    ),
    ignored("deployment.*", "rl starts the processes of each node", "launch.nodes, trainer.num_ranks"),
    # ---- orchestrator
    rename("orchestrator.rollouts_per_example", "orchestrator.group_size"),
    unsupported("orchestrator.token_batch_size", "batches are counted in samples", "orchestrator.batch_size"),
    rename("orchestrator.concurrency.max_inflight", "orchestrator.max_inflight"),
    ignored(
        "orchestrator.concurrency.*",
        "there is no adaptive concurrency controller",
        "orchestrator.max_inflight and orchestrator.rollout.max_concurrent",
    ),
    ignored(
        "orchestrator.tasks_per_minute",
        "rollouts are not rate-limited",
        "orchestrator.rollout.max_concurrent",
    ),
    ignored("orchestrator.env_server_base_port", "environments run inside the orchestrator (no env servers)"),
    ignored("orchestrator.collect_inference_metrics", "inference server metrics are not collected"),
    ignored("orchestrator.inference_metrics_roles", "inference server metrics are not collected"),
    rename("orchestrator.num_train_workers", "orchestrator.num_train_ranks"),
    ignored("orchestrator.pad_to_multiple_of", "there is no context parallelism"),
    ignored("orchestrator.renderer.*", "prompts are rendered with the model tokenizer's chat template"),
    rename(
        "orchestrator.client.base_url",
        "orchestrator.base_url",
        convert=lambda v: v[0] if isinstance(v, list) and len(v) == 1 else v,
    ),
    ignored(
        "orchestrator.client.*",
        "the orchestrator's client settings are its own",
        "orchestrator.base_url, orchestrator.inference_secret_env",
    ),
    ignored(
        "orchestrator.model.client.*",
        "rl starts the inference server and connects the orchestrator to it",
        "inference.host / inference.port",
    ),
    ignored("orchestrator.model.lora.name", _LORA_SERVED, "trainer.model.lora"),
    unsupported("orchestrator.model.lora.*", "LoRA is set once, for the trainer", "trainer.model.lora"),
    same(
        "orchestrator.algo.type",
        "the group-mean baseline (orchestrator.advantage) and the clipped policy "
        "gradient (trainer.loss.rl) are GRPO",
        lambda v: v == "grpo",
    ),
    unsupported("orchestrator.algo.length_penalty.*", _NO_LENGTH_PENALTY, "remove it"),
    unsupported(
        "orchestrator.algo.*",
        "the algorithm is GRPO-style RL (plus SDPO, replay)",
        "orchestrator.advantage and trainer.loss",
    ),
    rename("orchestrator.train.sampling.temperature", "orchestrator.sampling.temperature"),
    rename("orchestrator.train.sampling.max_completion_tokens", "orchestrator.sampling.max_tokens"),
    rename("orchestrator.train.sampling.extra_body.*", "orchestrator.sampling.extra_body.*"),
    rename("orchestrator.sampling.max_completion_tokens", "orchestrator.sampling.max_tokens"),
    rename(
        "orchestrator.train.filter_zero_advantages",
        "orchestrator.advantage.dynamic_sampling",
        why="zero-advantage groups are dropped and replaced",
    ),
    rename("orchestrator.eval.skip_first_step", "orchestrator.eval.at_start", convert=lambda v: not v),
    rename("orchestrator.eval.sampling.temperature", "orchestrator.eval.temperature"),
    ignored(
        "orchestrator.eval.sampling.*", "evaluation samples like training, at orchestrator.eval.temperature"
    ),
    ignored("orchestrator.eval.retrigger_on_resume", "a resumed run evaluates on its own schedule"),
    ignored(
        "orchestrator.eval.group_size",
        "evaluation during training samples once per task",
        "pass@k after training: uv run eval --num-samples k",
    ),
    ignored(
        "orchestrator.eval.num_examples",
        "there is no eval source it applies to",
        "orchestrator.env[].num_eval_examples",
    ),
    # ---- trainer
    rename(
        "trainer.optim.max_norm", "trainer.optim.max_grad_norm", convert=lambda v: 0.0 if v is None else v
    ),
    same("trainer.optim.type", "the optimizer is AdamW", lambda v: v == "adamw", instead="remove it"),
    unsupported("trainer.optim.*", "the optimizer is AdamW", "trainer.optim (lr, betas, eps, weight_decay)"),
    rename("trainer.scheduler.type", "trainer.optim.schedule"),
    rename("trainer.scheduler.warmup_steps", "trainer.optim.warmup_steps"),
    unsupported(
        "trainer.scheduler.decay_steps",
        "linear and cosine schedules decay from the end of warmup to the last step",
        "remove it",
    ),
    unsupported(
        "trainer.loss.*",
        "PRIME-RL's loss (DPPO masks, adv_tau, kl_tau) is not this trainer's",
        "trainer.loss.rl (eps_low/eps_high, mask_ratio_low/high, kl_coef)",
    ),
    rename("trainer.model.lora.rank", "trainer.model.lora.rank"),
    rename("trainer.model.lora.alpha", "trainer.model.lora.alpha"),
    rename("trainer.model.lora.dropout", "trainer.model.lora.dropout"),
    rename("trainer.model.lora.target_modules", "trainer.model.lora.target_modules"),
    unsupported(
        "trainer.model.lora.*",
        "adapters train the targeted linear layers only (no fully trained modules, no per-layer ranks)",
        "trainer.model.lora (rank, alpha, dropout, target_modules)",
    ),
    rename(
        "trainer.model.dp_replicate", "trainer.parallel.replicate", why="HSDP: copies of the sharded model"
    ),
    ignored("trainer.model.optimization_dtype", "precision is one switch here", "trainer.mixed_precision"),
    ignored("trainer.model.reduce_dtype", "precision is one switch here", "trainer.mixed_precision"),
    ignored(
        "trainer.model.*",
        "a kernel, parallelism or memory setting of PRIME-RL's trainer (FSDP2 "
        "shards every decoder layer here, with sdpa attention)",
    ),
    unsupported("trainer.data.*", "the trainer trains on the orchestrator's batches only", "remove it"),
    ignored("trainer.dist_timeout_seconds", "collectives use torch's default timeout"),
    ignored("trainer.enable_router_replay", "MoE router replay is not implemented"),
    ignored("trainer.matmul_precision", "float32 matmuls use torch's default precision"),
    ignored("trainer.gc.*", "Python's garbage collector runs as usual"),
    ignored("trainer.memory_profiler_path", "there is no memory profiler hook"),
    ignored("trainer.trace_path", "there is no trace hook"),
    ignored("trainer.enable_token_export", "there is no token export"),
    # ---- inference
    rename("inference.vllm.max_model_len", "inference.max_model_len"),
    rename("inference.vllm.model", "inference.model.name"),
    rename("inference.server.host", "inference.host"),
    rename("inference.server.port", "inference.port"),
    rename("inference.env_vars.*", "inference.vllm.env.*"),
    # inference.parallel.dp and deployment.num_infer_gpus: names.py (_data_parallel), whose target
    # depends on the backend; inference.vllm.data_parallel_size is ours (the same vLLM flag).
    rename("inference.parallel.tp", "inference.vllm.tensor_parallel_size"),
    *(
        ignored(
            key,
            "rl runs every data-parallel engine (and every replica) on its own node",
            "inference.vllm.data_parallel_size or inference.num_replicas",
        )
        for key in ("inference.vllm.data_parallel_size_local", "inference.data_parallel_size_local")
    ),
    *(
        ignored(key, _ONE_API_SERVER, "inference.vllm.data_parallel_size")
        for key in ("inference.vllm.api_server_count", "inference.api_server_count")
    ),
    ignored("inference.vllm.enable_return_routed_experts", "MoE router replay is not implemented"),
    ignored("inference.vllm.enable_lora", _LORA_VLLM, "trainer.model.lora"),
    ignored("inference.vllm.max_lora_rank", _LORA_VLLM, "trainer.model.lora.rank"),
    ignored(
        "inference.deployment.*",
        "rl starts inference replicas on its own node; servers on other nodes are started there",
        "inference.num_replicas, or orchestrator.base_url listing the other nodes' servers",
    ),
    ignored(
        "inference.router.*",
        "the orchestrator spreads rollouts over the replicas itself (least in flight, step gating)",
        "inference.num_replicas",
    ),
    ignored("inference.kv_cache_offload.*", "there is no KV cache offload"),
    ignored(
        "inference.weight_broadcast.*", "weights are published through the filesystem (broadcasts/step_N)"
    ),
    ignored("inference.slurm.*", "there is no SLURM launcher"),
)
"""Every PRIME-RL key this project knows, most specific first (the first matching rule applies)."""

"""PRIME-RL's config names, read as this project's own: ``rl @ prime-rl.toml`` and ``rl migrate``.

This project re-implements PRIME-RL's process split, so most of a PRIME-RL ``rl.toml`` means
something here too, under other names (``seq_len`` at the top is ``orchestrator.seq_len``,
``[[orchestrator.train.source]]`` with ``env.taskset`` is ``[[orchestrator.env]]`` with ``id`` and
``args``, ``[trainer.optim] max_norm`` is ``max_grad_norm``, ...). ``translate`` rewrites the merged
raw dict (files, flags and environment, before pydantic sees it), so every translated key keeps
the origin of the key it came from and errors still name the file.

Every PRIME-RL key falls in one of four kinds (``prime_rl/rules.py``; ``docs/prime-rl.md``):

- ``rename``: the same setting under our name (values converted where the units differ);
- ``same``: what this project always does (``harness.id = "null"``, ``weight_broadcast.type =
  "filesystem"``, ``algo.type = "grpo"``): dropped, since there is nothing to set;
- ``ignored``: only changes where or how fast the run goes (SLURM, deployment, kernels, renderers,
  logging): dropped with one note line saying so and what to use instead;
- ``unsupported``: would change what is trained (another optimizer or loss, LoRA settings beyond
  rank, alpha, dropout and targets, a length penalty): one error line each, all of them at once,
  and the run does not start.

A key that is valid in our own config is ours and never translated. Translating never hides a
conflict: a PRIME-RL key and our key for the same setting (or two PRIME-RL keys, e.g. two sources'
``group_size``) with different values is an error naming both.

Three generations of PRIME-RL's layout are read: ``[[orchestrator.env]]`` with ``id`` (which is
ours as well), ``[[orchestrator.train.env]]`` with ``taskset = {...}`` / ``env.taskset``, and the
newest ``[[orchestrator.train.source]]`` with ``env.taskset`` and ``env.agent.harness``; ``[wandb]``
and ``[monitors.wandb]``; ``rollouts_per_example`` and ``group_size``.
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from prime_composer.config.cli import DIALECTS, flatten, origin_of, resolve_field
from prime_composer.config.errors import ConfigError
from prime_composer.prime_rl.rules import REPLICAS_WHY, RULES, SEATS, VLLM_DP_WHY, Kind, Rule


@dataclass
class Finding:
    """What happened to one PRIME-RL key."""

    kind: Kind
    key: str
    value: Any
    origin: str
    ours: str = ""
    why: str = ""

    def line(self) -> str:
        shown = _show(self.value)
        if self.kind == "rename":
            return f"{self.key} = {shown} -> {self.ours}" + (f" ({self.why})" if self.why else "")
        if self.kind == "same":
            return f"{self.key} = {shown}: already how this project works ({self.why})"
        instead = f"; {_instead(self.ours)}" if self.ours else ""
        if self.kind == "ignored":
            return f"{self.origin}: {self.key} = {shown} (PRIME-RL) is ignored: {self.why}{instead}"
        return f"{self.origin}: {self.key} = {shown} (PRIME-RL) has no equivalent here: {self.why}{instead}"


@dataclass
class Translation:
    values: dict[str, Any]
    origins: dict[str, str]
    findings: list[Finding] = field(default_factory=list)

    def of_kind(self, *kinds: Kind) -> list[Finding]:
        return [f for f in self.findings if f.kind in kinds]


def translate(values: dict[str, Any], origins: dict[str, str], model: type[BaseModel]) -> Translation:
    """Rewrite PRIME-RL's keys in the merged raw ``values`` into ``model``'s (see the module docstring)."""
    return _Translator(values, origins, model).run()


class PrimeRLNames:
    """The translator ``config.cli.build_config`` runs before validating ``model``."""

    def __init__(self, model: type[BaseModel]) -> None:
        self.model = model

    def flag_target(self, dotted: str) -> str | None:
        """Our key for a ``--flag`` spelled the PRIME-RL way (its type parses the value)."""
        if _exists(self.model, dotted):
            return None
        for rule in RULES:
            if rule.kind == "rename" and rule.matches(dotted):
                target = _renamed(rule, dotted)
                return target if _exists(self.model, target) else None
        return None

    def __call__(self, values: dict[str, Any], origins: dict[str, str]) -> tuple[dict, dict, list[str]]:
        """The translated values and origins, and the notes to print; ``ConfigError`` listing every
        key that cannot be translated."""
        result = translate(values, origins, self.model)
        errors = result.of_kind("unsupported")
        if errors:
            raise ConfigError(
                "\n".join(f.line() for f in errors)
                + "\n(`uv run rl migrate <file>` prints the config in this project's names)"
            )
        return result.values, result.origins, [f.line() for f in result.of_kind("ignored")]


# ------------------------------------------------------------------------------------ translator


class _Translator:
    def __init__(self, values: dict[str, Any], origins: dict[str, str], model: type[BaseModel]) -> None:
        self.model = model
        self.flat = flatten(values)
        self.origins = dict(origins)
        self.out: dict[str, Any] = {}
        """Our keys set by translation (checked against each other and the user's own)."""
        self.findings: list[Finding] = []

    def run(self) -> Translation:
        self._sources()
        self._output_dir()
        self._optim()
        self._seq_len()
        self._vllm_passthrough()
        self._data_parallel()
        self._inference_gpus()
        self._deployment()
        for key in list(self.flat):
            if _exists(self.model, key):
                continue  # ours
            rule = next((r for r in RULES if r.matches(key)), None)
            if rule is not None:
                self._apply(rule, key, self.flat.pop(key))
        self._backend_note()
        return Translation(_unflatten({**self.flat, **self.out}), self.origins, self.findings)

    # ------------------------------------------------------------------------------- primitives

    def origin(self, key: str) -> str:
        return origin_of(key.split("[")[0], self.origins)

    def put(
        self,
        ours: str,
        value: Any,
        source: str,
        origin: str,
        why: str = "",
        record: bool = True,
        shown: Any = None,
    ) -> None:
        """Set our key ``ours`` from PRIME-RL's ``source`` (whose value was ``shown``, when it differs);
        a different value already there is an error."""
        for holder, where in ((self.flat, "set as"), (self.out, "translated to")):
            if ours in holder and holder[ours] != value:
                other = self.origins.get(ours, "defaults")
                raise ConfigError(
                    f"{origin}: {source} = {_show(value)} (PRIME-RL's name for {ours}) conflicts with "
                    f"{ours} = {_show(holder[ours])} ({other}, {where} {ours}); {ours} has one value: "
                    "set it once"
                )
        self.flat.pop(ours, None)
        self.out[ours] = value
        self.origins[ours] = f"{origin} (as {source})" if source != ours else origin
        if record:
            self.findings.append(
                Finding("rename", source, value if shown is None else shown, origin, ours, why)
            )

    def note(self, kind: Kind, key: str, value: Any, origin: str, why: str, instead: str = "") -> None:
        self.findings.append(Finding(kind, key, value, origin, instead, why))

    def _apply(self, rule: Rule, key: str, value: Any, origin: str | None = None) -> None:
        origin = origin or self.origin(key)
        if rule.kind == "rename":
            converted = rule.convert(value) if rule.convert is not None else value
            self.put(_renamed(rule, key), converted, key, origin, rule.why)
        elif rule.kind == "same" and (rule.when is None or rule.when(value)):
            self.note("same", key, value, origin, rule.why)
        else:
            kind = rule.otherwise if rule.kind == "same" else rule.kind
            self.note(kind, key, value, origin, rule.why, rule.ours)

    def _apply_rules(self, key: str, value: Any, origin: str) -> bool:
        rule = next((r for r in RULES if r.matches(key)), None)
        if rule is None:
            return False
        self._apply(rule, key, value, origin)
        return True

    # ---------------------------------------------------------------------------- special keys

    def _sources(self) -> None:
        """``[[orchestrator.train.source]]`` / ``[[orchestrator.train.env]]`` -> ``[[orchestrator.env]]``;
        eval sources become ``eval_args`` of the training environment with the same taskset."""
        envs: list[dict[str, Any]] = []
        for list_key in ("orchestrator.train.source", "orchestrator.train.env"):
            if list_key not in self.flat:
                continue
            origin = self.origin(list_key)
            if "orchestrator.env" in self.flat:
                raise ConfigError(
                    f"{origin}: {list_key} (PRIME-RL's name for orchestrator.env) and orchestrator.env "
                    f"({self.origin('orchestrator.env')}) are both set; list the environments once"
                )
            for i, source in enumerate(_as_tables(self.flat.pop(list_key), list_key, origin)):
                envs.append(self._source(source, f"{list_key}[{i}]", origin, train=True))
        if envs:
            self.put(
                "orchestrator.env",
                envs,
                "orchestrator.train.source",
                self.origin("orchestrator.train"),
                record=False,
            )
            self.findings.append(
                Finding(
                    "rename",
                    "orchestrator.train.source",
                    ...,
                    "",
                    "orchestrator.env",
                    "env.taskset.id -> id, the other taskset fields -> args",
                )
            )
        lists = [k for k in ("orchestrator.eval.source", "orchestrator.eval.env") if k in self.flat]
        if not lists:
            return  # group-level eval keys, if any, meet their rules (or the validation) later
        defaults = {
            key: self.flat.pop(f"orchestrator.eval.{key}")
            for key in ("num_examples", "group_size")
            if f"orchestrator.eval.{key}" in self.flat
        }
        for list_key in lists:
            origin = self.origin(list_key)
            for i, source in enumerate(_as_tables(self.flat.pop(list_key), list_key, origin)):
                self._eval_source({**defaults, **source}, f"{list_key}[{i}]", origin, envs)

    def _source(self, source: dict[str, Any], where: str, origin: str, train: bool) -> dict[str, Any]:
        flat = flatten(source)
        taskset = _taskset(source, where, origin)
        entry: dict[str, Any] = {"id": taskset.pop("id")}
        if taskset:
            entry["args"] = taskset
        for key, value in flat.items():
            full = f"{where}.{key}"
            if key.startswith(("env.taskset.", "taskset.")) or key == "env.taskset":
                continue
            if key in ("name", "ratio"):
                entry[key] = value
            elif key == "env.id":
                if value != entry["id"]:
                    self.note(
                        "unsupported",
                        full,
                        value,
                        origin,
                        "an environment is named by its taskset id",
                        f"{where}.env.taskset.id",
                    )
            elif key == "group_size" and train:
                self.put("orchestrator.group_size", value, full, origin)
            elif key.startswith("sampling.") and train:
                # One sampling config for every environment: the same value as the others, or a conflict.
                if not self._apply_rules(f"orchestrator.train.{key}", value, origin):
                    self.note(
                        "unsupported", full, value, origin, "a sampling field this project does not send"
                    )
            elif key == "algo.type" and value == "grpo":
                self.note("same", full, value, origin, "GRPO is the algorithm of every environment")
            elif key.startswith("algo."):
                self.note(
                    "unsupported",
                    full,
                    value,
                    origin,
                    "one algorithm for every environment",
                    "orchestrator.advantage and trainer.loss",
                )
            elif key.startswith("curriculum."):
                self._curriculum(key, value, full, origin)
            elif key.startswith("serve."):
                self.note(
                    "ignored",
                    full,
                    value,
                    origin,
                    "environments run inside the orchestrator (no env servers)",
                )
            else:
                self._seat(key, value, full, origin)
        return entry

    def _seat(self, key: str, value: Any, full: str, origin: str) -> None:
        """``env.<seat>.{harness,runtime,timeout,retries}`` (and the older ``harness = {...}``)."""
        parts = key.split(".")
        if parts[0] == "env" and len(parts) > 2 and parts[1] in SEATS:
            parts = parts[2:]
        elif parts[0] == "harness" and len(parts) > 2 and parts[1] == "runtime":
            parts = parts[1:]  # the oldest layout nests the runtime in the harness
        what = ".".join(parts)
        if what == "harness.id" and value == "null":
            self.note("same", full, value, origin, "episodes run with this project's own harness")
        elif what.startswith("harness."):
            self.note(
                "unsupported",
                full,
                value,
                origin,
                "episodes run with this project's own harness: one chat call, or its agent loop with "
                "sandboxed tools for tasks that use tools",
                "orchestrator.env[].agent",
            )
        elif what == "runtime.type" and value == "subprocess":
            self.note("same", full, value, origin, "environments run in the orchestrator's own processes")
        elif what.startswith("runtime."):
            self.note(
                "ignored",
                full,
                value,
                origin,
                "tools run in this project's sandbox",
                "orchestrator.env[].agent.sandbox",
            )
        elif what == "timeout.rollout":
            self.put("orchestrator.rollout.timeout_s", value, full, origin)
        elif what == "retries.max_retries":
            self.put("orchestrator.rollout.max_retries", value, full, origin)
        else:
            self.note(
                "unsupported",
                full,
                value,
                origin,
                "an environment setting this project does not read",
                "the environment's own args (env.taskset)",
            )

    def _curriculum(self, key: str, value: Any, full: str, origin: str) -> None:
        if key.endswith(".type") and value == "advantage_range":
            self.put(
                "orchestrator.advantage.dynamic_sampling",
                True,
                full,
                origin,
                "groups whose rewards are all equal are dropped and replaced",
                shown=value,
            )
        elif key == "curriculum.sampler.type" and value == "standard":
            self.note("same", full, value, origin, "tasks are drawn in the taskset's order")
        elif key.endswith((".reject_min", ".reject_max")) and value == 0:
            pass  # the advantage_range gate's defaults: exactly the zero-advantage groups
        else:
            self.note(
                "unsupported",
                full,
                value,
                origin,
                "tasks are drawn in order, with no curriculum",
                "remove it",
            )

    def _eval_source(
        self, source: dict[str, Any], where: str, origin: str, envs: list[dict[str, Any]]
    ) -> None:
        taskset = _taskset(source, where, origin)
        env_id = taskset.pop("id")
        match = next((e for e in envs if e["id"] == env_id), None)
        if match is None:
            self.note(
                "ignored",
                where,
                {"taskset": {"id": env_id}},
                origin,
                "evaluation during training runs held-out splits of the training environments",
                "add the taskset as an orchestrator.env entry with eval_args to evaluate it",
            )
            return
        train_args = match.get("args", {})
        match["eval_args"] = {k: v for k, v in taskset.items() if train_args.get(k) != v}
        self.findings.append(
            Finding(
                "rename",
                where,
                {"taskset": {"id": env_id}},
                origin,
                f"eval_args of the orchestrator.env entry {env_id!r}",
            )
        )
        for key, value in flatten(source).items():
            full = f"{where}.{key}"
            if key.startswith(("env.taskset", "taskset")) or key in ("name",):
                continue
            if key == "num_examples":
                if value is not None and value >= 0:
                    match["num_eval_examples"] = value
            elif key == "interval":
                self.put("orchestrator.eval.interval", value, full, origin)
            elif key == "group_size":
                if value != 1:
                    self.note(
                        "ignored",
                        full,
                        value,
                        origin,
                        "evaluation during training samples once per task",
                        "pass@k after training: uv run eval --num-samples k",
                    )
            elif key == "sampling.temperature":
                self.put("orchestrator.eval.temperature", value, full, origin)
            elif key.startswith("sampling."):
                self.note(
                    "ignored",
                    full,
                    value,
                    origin,
                    "evaluation samples like training, at orchestrator.eval.temperature",
                )
            else:
                self._seat(key, value, full, origin)

    def _copies(self) -> tuple[str, str]:
        """Where PRIME-RL's data-parallel engines go, and why: vLLM's own with the ``vllm`` backend
        (``inference.vllm.data_parallel_size``, one server as in PRIME-RL), else one server each
        (``inference.num_replicas``, which the ``hf`` backend can run)."""
        if self.flat.get("inference.backend") == "vllm":
            return "inference.vllm.data_parallel_size", VLLM_DP_WHY
        return "inference.num_replicas", (
            f"{REPLICAS_WHY} (with inference.backend = 'vllm': vLLM's own, inference.vllm.data_parallel_size)"
        )

    def _data_parallel(self) -> None:
        """``inference.parallel.dp`` (vLLM's ``--data-parallel-size`` in PRIME-RL) -> ``_copies``.

        ``inference.vllm.data_parallel_size`` is our key too, and stays as it is with the ``vllm``
        backend. In a file that speaks PRIME-RL (a key that is not ours) without the ``vllm``
        backend it becomes ``inference.num_replicas``, as PRIME-RL's engines do on ``hf``; in our
        own config on ``hf`` it stays, and ``rl`` refuses it (vLLM's parallelism without vLLM)."""
        key = "inference.parallel.dp"
        if key in self.flat:
            ours, why = self._copies()
            self.put(ours, self.flat.pop(key), key, self.origin(key), why)
        key = "inference.vllm.data_parallel_size"
        ours, why = self._copies()
        if key in self.flat and ours != key and any(not _exists(self.model, k) for k in self.flat):
            self.put(ours, self.flat.pop(key), key, self.origin(key), why)

    def _inference_gpus(self) -> None:
        """One node's ``num_infer_gpus`` -> ``num_infer_gpus / tensor_parallel_size`` data-parallel
        engines (what PRIME-RL fills them with; ``_copies`` says where they go), and PRIME-RL's
        GPU layout (inference on the first ``num_infer_gpus`` GPUs, the trainer on the next
        ``num_train_gpus``) -> ``launch.gpus``."""
        if "deployment.num_infer_gpus" not in self.flat or self.flat.get("deployment.type") == "multi_node":
            return
        key = "deployment.num_infer_gpus"
        infer = self.flat.pop(key)
        origin = self.origin(key)
        tp = self.flat.get("inference.vllm.tensor_parallel_size", self.flat.get("inference.parallel.tp", 1))
        train = self.flat.get("deployment.num_train_gpus", 1)  # its rule makes it trainer.num_ranks
        if not all(isinstance(v, int) and v >= 1 for v in (infer, tp, train)) or infer % tp:
            self.note(
                "unsupported",
                key,
                infer,
                origin,
                f"every inference replica takes tensor_parallel_size = {tp} GPUs",
                "a multiple of inference.vllm.tensor_parallel_size (inference.parallel.tp)",
            )
            return
        ours, why = self._copies()
        self.put(
            ours,
            infer // tp,
            key,
            origin,
            f"num_infer_gpus / tensor_parallel_size = {infer} / {tp}: {why}",
            shown=infer,
        )
        self.put(
            "launch.gpus.inference",
            list(range(infer)),
            key,
            origin,
            "the first GPUs, as in PRIME-RL",
            shown=infer,
        )
        self.put(
            "launch.gpus.trainer",
            list(range(infer, infer + train)),
            "deployment.num_train_gpus",
            origin,
            "the GPUs after inference's, as in PRIME-RL",
            shown=train,
        )

    def _deployment(self) -> None:
        """``[deployment] type = "multi_node"``: ``num_train_nodes`` -> ``launch.nodes``, its nodes'
        GPUs (``gpus_per_node``, 8 unless given) -> ``trainer.num_ranks`` (the ranks of all nodes),
        and ``num_infer_nodes > 0`` -> ``launch.remote_inference`` (the servers' URLs are
        ``orchestrator.client.base_url``). ``single_node`` is what ``rl`` does by default."""
        kind = self.flat.get("deployment.type")
        if kind is None and not any(
            f"deployment.{k}" in self.flat for k in ("num_train_nodes", "num_infer_nodes")
        ):
            return
        origin = self.origin("deployment")
        if kind is not None:
            self.flat.pop("deployment.type")
            if kind not in ("single_node", "multi_node"):
                self.note(
                    "unsupported",
                    "deployment.type",
                    kind,
                    origin,
                    "a deployment is single_node or multi_node",
                    "launch.nodes",
                )
                return
            why = (
                "rl runs the processes of this node"
                if kind == "single_node"
                else "rl runs on every node with its own launch.node_rank (infra/multinode/slurm.sbatch)"
            )
            self.note("same", "deployment.type", kind, origin, why)
            if kind == "single_node":
                return
        nodes = self.flat.pop("deployment.num_train_nodes", 1)
        self.put("launch.nodes", nodes, "deployment.num_train_nodes", origin, "trainer nodes")
        per_copy = self.flat.pop("deployment.nodes_per_fsdp_group", None)
        if per_copy is not None:
            key = "deployment.nodes_per_fsdp_group"
            if (
                not (isinstance(per_copy, int) and isinstance(nodes, int) and per_copy >= 1)
                or nodes % per_copy
            ):
                self.note(
                    "unsupported",
                    key,
                    per_copy,
                    origin,
                    f"each copy of the model (an FSDP island) takes whole nodes of the {nodes} trainer nodes",
                    "a divisor of deployment.num_train_nodes",
                )
            else:
                self.put(
                    "trainer.parallel.replicate",
                    nodes // per_copy,
                    key,
                    origin,
                    f"num_train_nodes / nodes_per_fsdp_group = {nodes} / {per_copy}: HSDP, one copy of the "
                    f"model sharded over every {per_copy} node(s)",
                    shown=per_copy,
                )
        gpus = self.flat.pop("deployment.gpus_per_node", 8)
        if isinstance(nodes, int) and isinstance(gpus, int):
            self.put(
                "trainer.num_ranks",
                nodes * gpus,
                "deployment.gpus_per_node",
                origin,
                f"num_train_nodes x gpus_per_node = {nodes} x {gpus}: the trainer ranks of all nodes",
                shown=gpus,
            )
        infer = self.flat.pop("deployment.num_infer_nodes", 0)
        if infer:
            self.put(
                "launch.remote_inference",
                True,
                "deployment.num_infer_nodes",
                origin,
                f"{infer} inference nodes run the servers (rl --launch.processes '[\"inference\"]' on each); "
                "the orchestrator calls orchestrator.base_url",
                shown=infer,
            )

    def _output_dir(self) -> None:
        """PRIME-RL writes to ``output_dir / run.name``; here ``output_dir`` is the run directory."""
        names = {k: self.flat.pop(k) for k in ("run.dir", "run.name") if k in self.flat}
        if not names:
            return
        source, name = next(iter(names.items()))  # run.dir wins, as in PRIME-RL
        parent = self.flat.pop("output_dir", "outputs")
        self.put(
            "output_dir",
            str(Path(parent) / name),
            source,
            self.origin(source),
            "output_dir is the run directory itself",
        )

    def _optim(self) -> None:
        """``betas1`` / ``betas2`` -> ``betas``; ``scheduler.min_lr`` -> ``min_lr_ratio``."""
        b1 = self.flat.pop("trainer.optim.betas1", None)
        b2 = self.flat.pop("trainer.optim.betas2", None)
        if b1 is not None or b2 is not None:
            from prime_composer.config.optim import OptimConfig

            default = OptimConfig().betas
            self.put(
                "trainer.optim.betas",
                [b1 if b1 is not None else default[0], b2 if b2 is not None else default[1]],
                "trainer.optim.betas1/betas2",
                self.origin("trainer.optim"),
            )
        if "trainer.scheduler.min_lr" in self.flat:
            from prime_composer.config.optim import OptimConfig

            min_lr = self.flat.pop("trainer.scheduler.min_lr")
            lr = self.out.get("trainer.optim.lr", self.flat.get("trainer.optim.lr", OptimConfig().lr))
            self.put(
                "trainer.optim.min_lr_ratio",
                min_lr / lr,
                "trainer.scheduler.min_lr",
                self.origin("trainer.scheduler.min_lr"),
                f"min_lr / lr = {min_lr} / {lr}",
            )

    def _seq_len(self) -> None:
        """``trainer.model.seq_len`` is the trainer's own row length in PRIME-RL; here the trainer
        reads the orchestrator's rows as they are, so it only counts when nothing else sets one."""
        if "trainer.model.seq_len" not in self.flat:
            return
        value = self.flat.pop("trainer.model.seq_len")
        origin = self.origin("trainer.model.seq_len")
        other = self.flat.get("orchestrator.seq_len", self.flat.get("seq_len"))
        if other is None:
            self.put("orchestrator.seq_len", value, "trainer.model.seq_len", origin)
        elif other != value:
            self.note(
                "ignored",
                "trainer.model.seq_len",
                value,
                origin,
                f"the trainer takes the orchestrator's packed rows (orchestrator.seq_len = {other})",
            )

    def _vllm_passthrough(self) -> None:
        """Other ``[inference.vllm]`` fields are vLLM's own arguments: passed on the command line."""
        args: list[str] = []
        for key in [k for k in self.flat if k.startswith("inference.vllm.")]:
            if _exists(self.model, key) or any(r.matches(key) for r in RULES):
                continue
            value = self.flat.pop(key)
            flag = "--" + key.removeprefix("inference.vllm.").replace("_", "-").replace(".", "-")
            words = (
                [flag] if value is True else [f"--no-{flag[2:]}"] if value is False else [flag, _arg(value)]
            )
            args += words
            self.findings.append(
                Finding(
                    "rename",
                    key,
                    value,
                    self.origin(key),
                    "inference.vllm.extra_args",
                    f"passed to vLLM as {' '.join(words)}",
                )
            )
        if args:
            mine = list(self.flat.pop("inference.vllm.extra_args", []))
            self.out["inference.vllm.extra_args"] = mine + args
            self.origins["inference.vllm.extra_args"] = self.origin("inference.vllm")

    def _backend_note(self) -> None:
        """A PRIME-RL config that tunes vLLM expects vLLM; here the backend is a choice."""
        vllm_keys = [k for k in (*self.flat, *self.out) if k.startswith("inference.vllm.")]
        if self.findings and vllm_keys and "inference.backend" not in self.flat:
            self.note(
                "ignored",
                "inference.vllm",
                ...,
                self.origin(vllm_keys[0]),
                "PRIME-RL always serves with vLLM, but inference.backend defaults to 'hf' (the embedded "
                "server) here, which does not read [inference.vllm]",
                "inference.backend = 'vllm'",
            )


# -------------------------------------------------------------------------------------- helpers


def _exists(model: type[BaseModel], dotted: str) -> bool:
    """Whether ``dotted`` is one of our keys: a field, or an entry of a field that is a free-form
    table (``inference.vllm.env.VLLM_CPU_KVCACHE_SPACE``, ``launch.gpus.trainer``)."""
    parts = dotted.split(".")
    for n in range(1, len(parts) + 1):
        try:
            annotation = resolve_field(model, ".".join(parts[:n]), "")
        except ConfigError:
            return False
        if n < len(parts) and _is_mapping(annotation):
            return True
    return True


def _is_mapping(annotation: Any) -> bool:
    """``dict[...]`` (or an optional one): its keys are data, not config keys."""
    options = (
        typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else (annotation,)
    )
    return any(typing.get_origin(a) is dict or a is dict for a in options)


def _renamed(rule: Rule, key: str) -> str:
    if rule.key.endswith(".*"):
        return rule.ours[:-2] + key[len(rule.key) - 2 :]
    return rule.ours


def _taskset(source: dict[str, Any], where: str, origin: str) -> dict[str, Any]:
    env = source.get("env")
    taskset = (env if isinstance(env, dict) else {}).get("taskset", source.get("taskset"))
    if not isinstance(taskset, dict) or "id" not in taskset:
        raise ConfigError(f"{origin}: {where} has no env.taskset.id: name the environment's taskset")
    return dict(taskset)


def _as_tables(value: Any, key: str, origin: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ConfigError(f"{origin}: {key} must be a list of tables ([[{key}]])")
    return value


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dotted, value in flat.items():
        node = out
        *parents, leaf = dotted.split(".")
        for part in parents:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        if isinstance(value, dict) and isinstance(node.get(leaf), dict):
            node[leaf].update(value)
        else:
            node[leaf] = value
    return out


_VERBS = ("remove", "run", "export", "save", "copy", "set", "pass", "use", "add", "evaluate")


def _instead(text: str) -> str:
    """What to do instead, as an imperative: a bare key becomes ``use <key>``."""
    return text if text.split(" ", 1)[0] in _VERBS else f"use {text}"


def _arg(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict | list) else str(value)


def _show(value: Any) -> str:
    if value is Ellipsis:
        return "{...}"
    text = json.dumps(value) if isinstance(value, dict | list | bool | None) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


DIALECTS.register("prime-rl", PrimeRLNames)

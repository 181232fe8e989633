"""Resolve an ``RLConfig`` from the command line: parse, validate, unify shared keys, wire processes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from prime_composer.config.channels import Pairing, Switched, Weighted, channels
from prime_composer.config.cli import CliOptions, build_config, dialect, origin_of
from prime_composer.config.errors import ConfigError
from prime_composer.config.ports import assign_free_ports, free_port
from prime_composer.config.processes import SECTION_NAMES, checkpoint_parts, node_processes, ranks_per_node
from prime_composer.config.rl import RLConfig
from prime_composer.config.shared import unify_shared_keys

ENV_PREFIX = "PRIME_COMPOSER_"
RL_ALIASES = {"--resume": "ckpt.resume=true"}
PRIME_RL_NAMES = dialect("prime-rl", RLConfig)
"""PRIME-RL's spelling of the same settings, accepted by ``rl`` (``prime_rl/names.py``)."""


def finalize_rl_config(config: RLConfig, origins: dict[str, str]) -> RLConfig:
    """Shared keys, then the wiring between processes the user should not have to repeat."""
    config = unify_shared_keys(config, origins)
    assign_free_ports(config)  # servers without a port in the config take a free one (config/ports.py)
    if config.ckpt.resume_step is not None and not config.ckpt.resume:
        set_shared(config, "ckpt.resume", True)
    parts = checkpoint_parts(config)
    if "ckpt.parts" in origins and tuple(config.ckpt.parts) != parts:
        raise ConfigError(
            f"{origins['ckpt.parts']}: ckpt.parts = {list(config.ckpt.parts)} but this run's processes write "
            f"{list(parts)}; remove ckpt.parts (rl sets it)"
        )
    set_shared(config, "ckpt.parts", parts)
    _copy_into(config, "trainer.num_ranks", "orchestrator.num_train_ranks", origins)
    _copy_into(config, "inference.secret_env", "orchestrator.inference_secret_env", origins)
    if config.transport.keep_last_steps <= config.max_async_level:
        raise ConfigError(
            f"{origin_of('transport.keep_last_steps', origins)}: transport.keep_last_steps = "
            f"{config.transport.keep_last_steps} must exceed max_async_level = {config.max_async_level}, "
            f"or the trainer could miss a step the orchestrator already deleted"
        )
    _check_nodes(config, origins)
    _check_gpus(config, origins)
    _check_channels(config, origins)
    _copy_diloco(config, origins)
    _copy_lora_rank(config, origins)
    inference = config.inference
    expected: str | list[str] = f"http://{client_host(inference.host)}:{inference.port}/v1"
    if inference.num_replicas > 1:  # the first replica on inference.port, the others on free ports
        taken = {inference.port, *([config.teacher.port] if config.teacher is not None else [])}
        taken |= {config.transport.port} if config.transport.kind == "zmq" else set()
        ports = [inference.port] + [
            free_port(inference.host, taken) for _ in range(inference.num_replicas - 1)
        ]
        expected = [f"http://{client_host(inference.host)}:{port}/v1" for port in ports]
    if "inference" not in {p.name for p in node_processes(config)}:
        _check_remote_inference(config, origins)
        return config
    if "base_url" in config.orchestrator.model_fields_set and config.orchestrator.base_url != expected:
        raise ConfigError(
            f"{origin_of('orchestrator.base_url', origins)}: "
            f"orchestrator.base_url = {config.orchestrator.base_url!r} but the launcher starts the "
            f"inference server at {expected}; remove orchestrator.base_url (rl sets it) or change "
            f"inference.host / inference.port"
        )
    config.orchestrator.base_url = expected
    return config


def _check_nodes(config: RLConfig, origins: dict[str, str]) -> None:
    """``trainer.num_ranks`` counts the ranks of every node: each node starts an equal share."""
    nodes, ranks = config.launch.nodes, config.trainer.num_ranks
    if ranks % nodes:
        raise ConfigError(
            f"{origin_of('trainer.num_ranks', origins)}: trainer.num_ranks = {ranks} with launch.nodes = "
            f"{nodes}: trainer.num_ranks counts the ranks of all nodes and each node starts the same "
            f"number, so make it a multiple of {nodes} (e.g. {nodes * max(1, ranks // nodes)})"
        )
    replicate, shard = config.trainer.mesh_shape
    per_node = ranks // nodes
    if replicate > 1 and shard % per_node and per_node % shard:
        raise ConfigError(
            f"{origin_of('trainer.parallel', origins)}: HSDP of {replicate} x {shard} ranks on launch.nodes = "
            f"{nodes} of {per_node} ranks each puts a copy's shards on parts of several nodes; make "
            f"trainer.parallel.shard divide {per_node} (shards within a node, e.g. replicate = {ranks // per_node}) "
            f"or a multiple of it (whole nodes per copy)"
        )


def _check_remote_inference(config: RLConfig, origins: dict[str, str]) -> None:
    """The orchestrator runs here but the inference servers elsewhere: it needs their URLs."""
    here = {p.name for p in node_processes(config)}
    if "orchestrator" in here and "base_url" not in config.orchestrator.model_fields_set:
        why = (
            f"launch.processes = {config.launch.processes}"
            if config.launch.processes is not None
            else "launch.remote_inference = true"
        )
        key = "launch.processes" if config.launch.processes is not None else "launch.remote_inference"
        raise ConfigError(
            f"{origin_of(key, origins)}: {why} starts "
            "the orchestrator without the inference server: set orchestrator.base_url to the servers' "
            "URLs (a list for several, e.g. ['https://infer-0:8000/v1', 'https://infer-1:8000/v1'])"
        )


def _copy_lora_rank(config: RLConfig, origins: dict[str, str]) -> None:
    """The inference server serves the trainer's adapters: vLLM must accept their rank."""
    model = config.trainer.model
    rank = model.lora.rank if model.lora is not None and model.lora.enabled else None
    given = config.inference.vllm.max_lora_rank
    if "inference.vllm.max_lora_rank" in origins and given != rank:
        raise ConfigError(
            f"{origin_of('inference.vllm.max_lora_rank', origins)}: inference.vllm.max_lora_rank = {given} "
            f"but trainer.model.lora.rank is {rank}; remove inference.vllm.max_lora_rank (rl sets it)"
        )
    config.inference.vllm.max_lora_rank = rank


def _check_gpus(config: RLConfig, origins: dict[str, str]) -> None:
    """``launch.gpus`` gives the trainer one GPU per rank and vLLM one per tensor-parallel shard."""
    gpus = config.launch.gpus
    where = origin_of("launch.gpus", origins)
    per_node = ranks_per_node(config)
    if "trainer" in gpus and len(gpus["trainer"]) != per_node:
        of_nodes = f" / launch.nodes = {config.launch.nodes}" if config.launch.nodes > 1 else ""
        raise ConfigError(
            f"{where}: launch.gpus.trainer has {len(gpus['trainer'])} GPUs but trainer.num_ranks = "
            f"{config.trainer.num_ranks}{of_nodes} ranks run on this node; the trainer runs one rank per "
            "GPU, so make them equal"
        )
    _check_data_parallel(config, origins)
    tensor_parallel = config.inference.vllm.tensor_parallel_size
    if "inference" in gpus and len(gpus["inference"]) < config.inference.num_gpus:
        raise ConfigError(
            f"{where}: launch.gpus.inference has {len(gpus['inference'])} GPUs but "
            f"inference.vllm.tensor_parallel_size = {tensor_parallel}; give it at least that many"
        )
    replicas = config.inference.num_replicas
    if "inference" in gpus and replicas > 1 and len(gpus["inference"]) % replicas:
        raise ConfigError(
            f"{where}: launch.gpus.inference has {len(gpus['inference'])} GPUs for inference.num_replicas = "
            f"{replicas}; each replica takes an equal share in order, so give a multiple of {replicas}"
        )
    if "inference" in gpus and len(gpus["inference"]) // replicas < config.inference.num_gpus:
        raise ConfigError(
            f"{where}: launch.gpus.inference gives each of the {replicas} replicas "
            f"{len(gpus['inference']) // replicas} GPUs but inference.vllm.tensor_parallel_size = "
            f"{tensor_parallel}; give every replica at least that many"
        )


def _check_data_parallel(config: RLConfig, origins: dict[str, str]) -> None:
    """``inference.vllm.data_parallel_size``: vLLM's engines in one server, on exactly
    ``tensor_parallel_size x data_parallel_size`` GPUs, and not together with replicas."""
    inference = config.inference
    vllm = inference.vllm
    if vllm.data_parallel_size == 1:
        return
    where = origin_of("inference.vllm.data_parallel_size", origins)
    dp = f"inference.vllm.data_parallel_size = {vllm.data_parallel_size}"
    if inference.backend != "vllm":
        raise ConfigError(
            f"{where}: {dp} is vLLM's data parallelism but inference.backend = {inference.backend!r}; set "
            f"inference.backend = 'vllm', or start copies of the {inference.backend} server with "
            f"inference.num_replicas = {vllm.data_parallel_size} instead"
        )
    if inference.num_replicas > 1:
        total = inference.num_replicas * vllm.data_parallel_size
        raise ConfigError(
            f"{where}: {dp} and inference.num_replicas = {inference.num_replicas} both make copies of the "
            f"model; choose one: inference.num_replicas = {total} servers (the orchestrator spreads "
            f"rollouts and a failed one is taken out), or one server with inference.vllm.data_parallel_size "
            f"= {total} (vLLM spreads them)"
        )
    gpus = config.launch.gpus.get("inference")
    if gpus is not None and len(gpus) != vllm.num_gpus:
        raise ConfigError(
            f"{origin_of('launch.gpus', origins)}: launch.gpus.inference has {len(gpus)} GPUs but vLLM's "
            f"{vllm.data_parallel_size} data-parallel engines of inference.vllm.tensor_parallel_size = "
            f"{vllm.tensor_parallel_size} take {vllm.num_gpus}: list exactly that many (engine i runs on "
            f"the i-th {vllm.tensor_parallel_size} of them)"
        )


def set_shared(config: RLConfig, dotted: str, value: object) -> None:
    """Set a shared key (``"ckpt.resume"``) at the top level and in every section that has it."""
    *parents, leaf = dotted.split(".")
    for holder in [config, *(getattr(config, name) for name in SECTION_NAMES)]:
        node = holder
        for part in parents:
            node = getattr(node, part, None)
            if node is None:
                break
        if node is not None and leaf in type(node).model_fields:
            setattr(node, leaf, value)


def _copy_diloco(config: RLConfig, origins: dict[str, str]) -> None:
    """``[diloco]`` runs in the trainer: set at the top level (each data center's file swaps it) or
    in the trainer's section (``--trainer @ t.toml``), and then it must be the same in both."""
    top_set = any(key == "diloco" or key.startswith("diloco.") for key in origins)
    section_keys = [key for key in origins if key == "trainer.diloco" or key.startswith("trainer.diloco.")]
    if section_keys and top_set and config.trainer.diloco != config.diloco:
        raise ConfigError(
            f"{origins[section_keys[0]]}: trainer.diloco differs from [diloco] "
            f"({origin_of('diloco', origins)}); set it once, at the top level"
        )
    if section_keys and not top_set:
        config.diloco = config.trainer.diloco
    config.trainer.diloco = config.diloco
    if config.diloco.enabled:  # each DC draws its own data (diloco.data_seed)
        config.orchestrator.seed = config.diloco.data_seed_for(config.seed)


def _check_channels(config: RLConfig, origins: dict[str, str]) -> None:
    """Every channel's checks across processes (``config/channels.py``): both halves on together,
    then the channel's own."""
    for spec in channels():
        if spec.pairing is not None:
            _check_pairing(config, origins, spec.name, spec.pairing)
        if spec.resolve is not None:
            spec.resolve(config, origins)


def _check_pairing(config: RLConfig, origins: dict[str, str], name: str, pairing: Pairing) -> None:
    """A channel's orchestrator half and its trainer weight need each other: one without the other
    would silently do nothing (or waste the orchestrator's work), so it is an error."""
    enabled = cast(Switched, config.orchestrator.section(name)).enabled
    weight = cast(Weighted, config.trainer.loss.section(name)).weight
    switch, weight_key = f"orchestrator.{name}.enabled", f"trainer.loss.{name}.weight"
    if enabled and weight == 0:
        raise ConfigError(
            f"{origin_of(switch, origins)}: {switch} = true but {weight_key} = 0, so {pairing.items} would "
            f"never be trained on: set {weight_key} > 0 (e.g. {pairing.example_weight}) or {switch} = false"
        )
    if weight > 0 and not enabled:
        raise ConfigError(
            f"{origin_of(weight_key, origins)}: {weight_key} = {weight} but {switch} = false, so "
            f"{pairing.nothing}: set {switch} = true or {weight_key} = 0"
        )


def _copy_into(config: RLConfig, source: str, target: str, origins: dict[str, str]) -> None:
    """Set ``target`` from ``source`` (one process's setting another must follow); a different
    explicit value in ``target`` is an error naming both."""
    src_section, src_key = source.split(".")
    dst_section, dst_key = target.split(".")
    value = getattr(getattr(config, src_section), src_key)
    dst = getattr(config, dst_section)
    if target in origins and getattr(dst, dst_key) != value:
        raise ConfigError(
            f"{origins[target]}: {target} = {getattr(dst, dst_key)!r} conflicts with {source} = {value!r}; "
            f"remove {target}: it is copied from {source}"
        )
    setattr(dst, dst_key, value)


def client_host(bind_host: str) -> str:
    """The address a client on this machine uses for a server bound to ``bind_host``."""
    return "127.0.0.1" if bind_host in ("0.0.0.0", "::", "") else bind_host


def resolve_rl_config(argv: Sequence[str]) -> tuple[RLConfig, CliOptions]:
    """The resolved config for ``argv`` (raises ConfigError on user mistakes)."""
    return build_config(
        argv,
        RLConfig,
        env_prefix=ENV_PREFIX,
        aliases=RL_ALIASES,
        finalize=finalize_rl_config,
        translate=PRIME_RL_NAMES,
    )

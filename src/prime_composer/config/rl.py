"""``RLConfig``: the root config of ``rl``, holding one section per process plus shared keys."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from prime_composer.config.base import MAX_LR, MAX_STEPS, BaseConfig
from prime_composer.config.common import CommonConfig
from prime_composer.config.diloco import DilocoConfig
from prime_composer.config.inference import InferenceConfig
from prime_composer.config.orchestrator import OrchestratorConfig
from prime_composer.config.teacher import TeacherServiceConfig
from prime_composer.config.tracking import WandbConfig
from prime_composer.config.trainer import TrainerConfig


class LaunchConfig(BaseConfig):
    """How the ``rl`` launcher starts, watches and stops the processes."""

    health_timeout_s: float = Field(default=300.0, gt=0)
    """Seconds to wait for the inference server's ``/health`` before giving up."""

    stop_timeout_s: float = Field(default=10.0, gt=0)
    """Seconds a process gets to exit after SIGTERM before it is killed."""

    progress: bool = True
    """Show the live progress display (turn off for plain logs, e.g. in CI)."""

    refresh_s: float = Field(default=1.0, gt=0)
    """Seconds between progress display refreshes."""

    gpus: dict[str, list[int]] = Field(default_factory=dict)
    """GPUs per process on this node, e.g. ``{inference = [0, 1], trainer = [2, 3, 4, 5, 6, 7]}``:
    each listed process sees only its own (``CUDA_VISIBLE_DEVICES``), so the inference server and
    the trainer never share one. A process left out sees every GPU. The trainer needs one GPU per
    rank (``trainer.num_ranks``); vLLM one per tensor-parallel shard."""

    overwrite: bool = False
    """Start fresh even when ``output_dir`` holds checkpoints of an earlier run (they are deleted,
    with its rollouts, broadcasts, metrics and logs). Without it such a run must be resumed
    (``--resume``) or given another ``output_dir``."""

    nodes: int = Field(default=1, ge=1, le=4096)
    """Nodes the trainer spans. ``rl`` runs on each of them (the same command and config, with its
    own ``launch.node_rank``) and starts that node's ``trainer.num_ranks / nodes`` ranks under
    torchrun's c10d rendezvous; FSDP2 shards over every rank of every node. Node 0 also runs the
    orchestrator and the inference server (``launch.processes`` changes that). Every node must
    see the same ``output_dir`` (a shared filesystem): ranks read their batches from it and write
    their checkpoint shards into it."""

    node_rank: int = Field(default=0, ge=0)
    """This node's index, ``0 .. nodes - 1`` (SLURM: ``$SLURM_NODEID``). Node 0 hosts the
    rendezvous and prepares ``output_dir`` (a fresh start's clean-up, a resume's trimming)."""

    rdzv_endpoint: str = "127.0.0.1:29400"
    """``host:port`` of the trainer's rendezvous, hosted by node 0 (with ``nodes > 1``). The
    default keeps it on this machine (several "nodes" on one host); across machines give node 0's
    address on the cluster network, with ``launch.private_network = true``. Global ranks are
    assigned by the rendezvous: each node's ranks are contiguous, in no promised node order."""

    private_network: bool = False
    """The nodes talk over a private network (a cluster fabric, a VPN): torch's rendezvous store
    and the gloo/NCCL collectives authenticate nothing, so a ``rdzv_endpoint`` off loopback is
    refused without this."""

    rdzv_timeout_s: float = Field(default=1800.0, gt=0)
    """How long a node waits for the others to join the rendezvous (node 0 joins only after its
    warm-up, if any, and after the inference server is healthy)."""

    remote_inference: bool = False
    """The inference servers run on other machines (PRIME-RL's inference nodes, each started
    there, e.g. ``rl --launch.processes '["inference"]'``): ``rl`` starts none and the orchestrator
    uses ``orchestrator.base_url`` as given (a list for several servers)."""

    processes: list[str] | None = None
    """The processes ``rl`` starts on this node; ``None``: every process of the run on node 0, the
    trainer alone on the others. Leave ``inference`` out where the servers run on other machines
    (list them in ``orchestrator.base_url``); ``["inference"]`` makes an inference-only node.
    The run's checkpoints still hold every process's part."""

    @model_validator(mode="after")
    def _check_nodes(self) -> LaunchConfig:
        from prime_composer.config.processes import SECTION_NAMES
        from prime_composer.netaddr import is_loopback

        if self.node_rank >= self.nodes:
            raise ValueError(
                f"launch.node_rank = {self.node_rank} with launch.nodes = {self.nodes}: node ranks are "
                f"0 .. {self.nodes - 1}"
            )
        host, _ = split_endpoint(self.rdzv_endpoint)
        if self.nodes > 1 and not is_loopback(host) and not self.private_network:
            raise ValueError(
                f"launch.rdzv_endpoint = {self.rdzv_endpoint!r} is reachable from other machines, and "
                "torch's rendezvous and collectives authenticate nothing: set launch.private_network = "
                "true if the nodes share a private network (cluster fabric, VPN)"
            )
        for name in self.processes or []:
            if name not in SECTION_NAMES:
                raise ValueError(
                    f"launch.processes: {name!r} is not a process; the processes are {', '.join(SECTION_NAMES)}"
                )
        if self.processes is not None and not self.processes:
            raise ValueError("launch.processes = []: list the processes this node runs, or leave it out")
        return self

    @field_validator("rdzv_endpoint")
    @classmethod
    def _check_endpoint(cls, endpoint: str) -> str:
        split_endpoint(endpoint)
        return endpoint

    @field_validator("gpus")
    @classmethod
    def _check_gpus(cls, gpus: dict[str, list[int]]) -> dict[str, list[int]]:
        from prime_composer.config.processes import SECTION_NAMES

        seen: dict[int, str] = {}
        for name, ids in gpus.items():
            if name not in SECTION_NAMES:
                raise ValueError(
                    f"launch.gpus.{name}: not a process; the processes are {', '.join(SECTION_NAMES)}"
                )
            if not ids or any(i < 0 for i in ids):
                raise ValueError(
                    f"launch.gpus.{name} = {ids}: list GPU indices (0, 1, ...), or leave the process out"
                )
            for i in ids:
                if i in seen:
                    raise ValueError(
                        f"launch.gpus: GPU {i} is given to both {seen[i]} and {name}; give each process its own"
                    )
                seen[i] = name
        return gpus


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``(host, port)`` of ``launch.rdzv_endpoint`` (``host:port``, ``[v6]:port``); ``ValueError``
    saying what is wrong otherwise."""
    host, sep, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(
            f"launch.rdzv_endpoint = {endpoint!r}: give host:port, e.g. '10.0.0.1:29400' (IPv6 as "
            "'[fd00::1]:29400')"
        )
    return host, int(port)


class WarmupConfig(BaseConfig):
    """An optional supervised warm-up before RL (a tiny random model needs one to get any reward).

    The launcher writes SFT data from the orchestrator's environments (reference answers of the
    train split) unless ``data`` is given, runs ``sft`` on it, and starts RL from the result
    (``<output_dir>/sft/final``).
    """

    enabled: bool = False
    """Run the warm-up before RL."""

    data: Path | None = None
    """JSONL of chats (``{"messages": [...]}`` per line) to train on; ``None`` generates it from the
    environments' train split."""

    num_examples: int = Field(default=1000, ge=1)
    """Conversations to generate when ``data`` is not given."""

    max_steps: int = Field(default=30, ge=1, le=MAX_STEPS)
    """SFT optimizer steps."""

    batch_size: int = Field(default=16, ge=1)
    """Conversations per SFT step."""

    lr: float = Field(default=1e-3, gt=0, le=MAX_LR)
    """SFT learning rate (constant)."""

    label_smoothing: float = Field(default=0.0, ge=0.0, lt=1.0)
    """SFT label smoothing (``sft.label_smoothing``). A smoothed warm-up learns to rank the
    reference answer first without becoming confident in it, which leaves RL room to improve."""

    only: bool = False
    """Stop after the warm-up (and the local teachers' warm-ups) instead of starting RL: the
    model is left in ``<output_dir>/sft/final`` for runs that start from it with ``--model.name
    <output_dir>/sft/final --warmup.enabled false`` (``ablate`` shares one warm-up per seed this
    way)."""


class RLConfig(BaseSettings, CommonConfig):
    """Everything ``rl`` needs: shared keys at the top, one section per process.

    Shared keys (``model``, ``output_dir``, ``max_steps``, ``seed``, ``max_async_level``,
    ``ckpt``, ``transport``) are set once here and copied into every section that uses them.
    """

    model_config = SettingsConfigDict(
        env_prefix="PRIME_COMPOSER_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
        use_attribute_docstrings=True,
        protected_namespaces=(),
        allow_inf_nan=False,
    )

    trainer: TrainerConfig = TrainerConfig()
    """The trainer process."""

    orchestrator: OrchestratorConfig = OrchestratorConfig()
    """The orchestrator process."""

    inference: InferenceConfig = InferenceConfig()
    """The inference server process."""

    teacher: TeacherServiceConfig | None = None
    """The trace-replay teacher service, started by ``rl`` when this section is present (its pool
    of teacher endpoints has no default): it replays rollouts and traces and writes DPO pairs that
    ``orchestrator.replay`` mixes into batches."""

    diloco: DilocoConfig = DilocoConfig()
    """The optional Streaming DiLoCo outer loop: this run is one data center of several (``[diloco]``)."""

    warmup: WarmupConfig = WarmupConfig()
    """Optional SFT warm-up stage before RL."""

    launch: LaunchConfig = LaunchConfig()
    """The launcher itself."""

    wandb: WandbConfig | None = None
    """Optional experiment tracking: one W&B run per launch, fed from ``metrics/*.jsonl``
    (``[wandb]``; an empty table turns it on with the defaults)."""

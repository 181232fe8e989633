"""``rl``: one command that runs inference, orchestrator and trainer together.

    uv run rl @ configs/quickstart.toml
    uv run rl --trainer @ t.toml --orchestrator @ o.toml --inference @ i.toml --max-steps 50
    uv run rl @ configs/quickstart.toml --resume

It resolves the config, writes each process's resolved config to ``<output_dir>/configs/``
(so any process can be rerun alone: ``uv run trainer @ <output_dir>/configs/trainer.json``),
starts the processes with logs in ``<output_dir>/logs/``, shows progress from
``<output_dir>/metrics/``, and stops everything together on error, Ctrl-C or SIGTERM.

With ``launch.nodes > 1`` the same command runs on every node (``--launch.node-rank k``): node 0
is the head (everything above, plus its share of the trainer's ranks), the others start their
ranks only (``_launch_node``); see docs/architecture.md, "The trainer across nodes".
"""

from __future__ import annotations

import hashlib
import json
import shlex
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from prime_composer.checkpoint_layout import find_resume_point
from prime_composer.config.errors import RUN_ERROR_EXIT_CODE, ConfigError
from prime_composer.config.inference import InferenceConfig
from prime_composer.config.processes import enabled_processes, node_processes, ranks_per_node
from prime_composer.config.resolve import (
    ENV_PREFIX,
    PRIME_RL_NAMES,
    RL_ALIASES,
    finalize_rl_config,
    set_shared,
)
from prime_composer.config.rl import RLConfig, split_endpoint
from prime_composer.io import atomic_write_text
from prime_composer.launch import remote, teachers
from prime_composer.launch.launcher import Launcher, LaunchResult
from prime_composer.launch.preflight import preflight
from prime_composer.launch.process import ProcessSpec
from prime_composer.launch.progress import Progress
from prime_composer.launch.rundir import lock_run_dir, prepare_fresh, prepare_resume
from prime_composer.netaddr import is_loopback
from prime_composer.report import summary, write_report_png


def write_resolved_configs(config: RLConfig, config_dir: Path | None = None) -> dict[str, Path]:
    """``<output_dir>/configs/rl.json`` and one ``<process>.json`` per process; returns their paths.
    (``config_dir``: elsewhere; a node that does not prepare ``output_dir`` writes its own.)

    Secrets never reach these files: configs hold the *names* of environment variables that
    hold secrets, and any secret-typed field is dumped redacted.
    """
    config_dir = config.output_dir / "configs" if config_dir is None else config_dir
    paths = {"rl": config_dir / "rl.json"}
    atomic_write_text(paths["rl"], json.dumps(config.model_dump(mode="json"), indent=2) + "\n")
    for process in enabled_processes(config):
        paths[process.name] = config_dir / f"{process.name}.json"
        section = getattr(config, process.name)
        atomic_write_text(paths[process.name], json.dumps(section.model_dump(mode="json"), indent=2) + "\n")
    replicas = inference_replicas(config)
    if len(replicas) > 1:  # one config per replica: inference-<i>.json, each with its own port
        for i, replica in enumerate(replicas):
            paths[f"inference-{i}"] = config_dir / f"inference-{i}.json"
            atomic_write_text(
                paths[f"inference-{i}"], json.dumps(replica.model_dump(mode="json"), indent=2) + "\n"
            )
    return paths


def inference_replicas(config: RLConfig) -> list[InferenceConfig]:
    """The config of each inference replica ``rl`` starts: the section itself for one, copies on
    the ports of ``orchestrator.base_url`` (which the resolver chose) for several."""
    if config.inference.num_replicas == 1:
        return [config.inference]
    ports = [urlsplit(url).port for url in config.orchestrator.server_urls]
    return [config.inference.model_copy(update={"port": port}) for port in ports]


def _health_url(section: Any, path: str) -> str:
    host = "127.0.0.1" if section.host in ("0.0.0.0", "::", "") else section.host
    return f"http://{host}:{section.port}{path}"


def check_resumed_model(config: RLConfig) -> None:
    """Refuse ``--resume`` with another model than the run trained from. With the warm-up on, the
    processes are handed the warm-up's result (``sft/final``) whatever ``model.name`` says, so a
    changed model would otherwise be ignored silently; the warm-up's own config (``configs/sft.json``)
    names the model it started from, ``configs/rl.json`` the one RL trained without a warm-up."""
    configs = config.output_dir / "configs"
    source = configs / (
        "sft.json" if config.warmup.enabled and (configs / "sft.json").is_file() else "rl.json"
    )
    try:
        saved = json.loads(source.read_text())["model"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # nothing recorded (the run never started): the trainer checks its checkpoint anyway
    now = config.model.model_dump(mode="json")
    differ = [key for key in ("name", "revision", "gguf_file") if saved.get(key) != now.get(key)]
    if differ:
        changes = ", ".join(f"model.{key} = {now.get(key)!r} (the run: {saved.get(key)!r})" for key in differ)
        raise ConfigError(
            f"--resume with {changes}, recorded in {source}: a checkpoint continues the model it trained. "
            "Resume with the run's model, or start a new run in another output_dir"
        )


def build_specs(config: RLConfig, config_paths: dict[str, Path]) -> list[ProcessSpec]:
    """The processes of one run (``config/processes.py``), in start order."""
    specs = []
    for process in node_processes(config):
        if process.name == "inference" and config.inference.num_replicas > 1:
            specs += _replica_specs(config, config_paths, process.module, process.health_path or "/health")
            continue
        argv = ["-m", process.module, "@", str(config_paths[process.name])]
        if process.num_ranks is not None and process.num_ranks(config) > 1:
            argv = [*torchrun_argv(config), *argv]
        health_url = None
        if process.health_path is not None:
            health_url = _health_url(getattr(config, process.name), process.health_path)
        gpus = config.launch.gpus.get(process.name)
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))} if gpus else {}
        specs.append(
            ProcessSpec(
                name=process.name,
                argv=[sys.executable, *argv],
                kind=process.kind,
                health_url=health_url,
                env=env,
                waits_for=process.waits_for,
                starts_early=process.starts_early,
            )
        )
    return specs


def torchrun_argv(config: RLConfig) -> list[str]:
    """``-m prime_composer.launch.torchrun ...``: this node's share of the trainer's ranks.

    One node: a standalone rendezvous on a free loopback port. Several: torchrun's c10d
    rendezvous at ``launch.rdzv_endpoint`` (hosted by node 0; ``is_host`` is explicit, so several
    "nodes" on one host work), one run id for all nodes (from ``output_dir``), no restarts (a
    failed rank fails the run, which ``--resume`` continues). Every server it starts listens on
    the endpoint's host on node 0, and on the address that reaches it elsewhere
    (``launch/torchrun.py``)."""
    launch = config.launch
    per_node = ranks_per_node(config)
    if launch.nodes == 1:
        return [
            "-m",
            "prime_composer.launch.torchrun",
            "--bind-host",
            "127.0.0.1",
            "--standalone",
            "--local-addr=127.0.0.1",
            f"--nproc-per-node={per_node}",
        ]
    host, _ = split_endpoint(launch.rdzv_endpoint)
    first = launch.node_rank == 0
    timeout = int(launch.rdzv_timeout_s)
    run_id = "prime-composer-" + hashlib.sha256(str(config.output_dir.resolve()).encode()).hexdigest()[:16]
    bind = host if first or is_loopback(host) else f"route:{host}"
    return [
        "-m",
        "prime_composer.launch.torchrun",
        "--bind-host",
        bind,
        f"--nnodes={launch.nodes}",
        f"--node-rank={launch.node_rank}",
        f"--nproc-per-node={per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={launch.rdzv_endpoint}",
        f"--rdzv-id={run_id}",
        # read_timeout: how long a node's agent keeps trying to reach node 0's store (node 0 starts
        # its trainer after its warm-up and a healthy inference server, minutes later).
        f"--rdzv-conf=is_host={str(first).lower()},join_timeout={timeout},read_timeout={timeout}",
        "--max-restarts=0",
    ]


def _replica_specs(
    config: RLConfig, config_paths: dict[str, Path], module: str, health_path: str
) -> list[ProcessSpec]:
    """One ``inference-<i>`` service per replica, each with its own config, port, log and share of
    ``launch.gpus.inference``; the run goes on while one of them is up (``group``)."""
    replicas = inference_replicas(config)
    gpus = config.launch.gpus.get("inference")
    share = len(gpus) // len(replicas) if gpus else 0
    specs = []
    for i, replica in enumerate(replicas):
        mine = gpus[i * share : (i + 1) * share] if gpus else []
        specs.append(
            ProcessSpec(
                name=f"inference-{i}",
                argv=[sys.executable, "-m", module, "@", str(config_paths[f"inference-{i}"])],
                kind="service",
                health_url=_health_url(replica, health_path),
                env={"CUDA_VISIBLE_DEVICES": ",".join(map(str, mine))} if mine else {},
                group="inference",
            )
        )
    return specs


def _resume_hint(config: RLConfig, argv: Sequence[str], result: LaunchResult) -> str:
    """`` To continue: <command>`` when resuming can help: a checkpoint exists and the run did not
    stop for a reason resuming would meet again."""
    if result.failed_exit_code == RUN_ERROR_EXIT_CODE:
        return f" Resuming as it is would stop the same way: see the error above in logs/{result.failed}.log."
    try:
        find_resume_point(config.output_dir / "checkpoints", None, config.ckpt.parts)
    except ConfigError:
        return " No checkpoint to resume from yet: fix the cause and run the same command again."
    return f" To continue: {resume_command(argv)}"


def resume_command(argv: Sequence[str]) -> str:
    args = list(argv)
    if "--resume" not in args:
        args.append("--resume")
    return "uv run rl " + shlex.join(args)


def warmup_specs(config: RLConfig, config_paths: dict[str, Path]) -> tuple[list[ProcessSpec], Path]:
    """The SFT warm-up stage: write data from the environments (unless given), then ``sft``.

    Returns the stage's processes and the directory of the fine-tuned model.
    """
    from prime_composer.config.sft import SFTConfig

    warmup = config.warmup
    python = sys.executable
    specs = []
    data = warmup.data
    if data is None:
        data = config.output_dir / "sft" / "data.jsonl"
        specs.append(
            ProcessSpec(
                name="sft-data",
                argv=[
                    python,
                    "-m",
                    "prime_composer.orchestrator.sft_export",
                    "--config",
                    str(config_paths["orchestrator"]),
                    "--out",
                    str(data),
                    "--num-examples",
                    str(warmup.num_examples),
                    # The run's seed, not the orchestrator's (a DiLoCo DC's own data seed): every
                    # DC warms up on the same data, so the DCs start from the same weights.
                    "--seed",
                    str(config.seed),
                ],
                kind="job",
            )
        )
    sft = SFTConfig(
        model=config.model,
        output_dir=config.output_dir,
        data=data,
        max_steps=warmup.max_steps,
        batch_size=warmup.batch_size,
        micro_batch_size=warmup.batch_size,
        seq_len=config.orchestrator.seq_len,
        label_smoothing=warmup.label_smoothing,
        seed=config.seed,
        num_threads=config.trainer.num_threads,
        optim=config.trainer.optim.model_copy(
            update={"lr": warmup.lr, "warmup_steps": 0, "schedule": "constant"}
        ),
    )
    sft_path = config.output_dir / "configs" / "sft.json"
    atomic_write_text(sft_path, json.dumps(sft.model_dump(mode="json"), indent=2) + "\n")
    specs.append(
        ProcessSpec(
            name="sft", argv=[python, "-m", "prime_composer.trainer.sft", "@", str(sft_path)], kind="job"
        )
    )
    return specs, config.output_dir / "sft" / "final"


def _use_model(config: RLConfig, path: Path) -> None:
    """Point every process at ``path`` (the warm-up's result: a plain Hugging Face folder, also
    when the warm-up started from a GGUF file)."""
    set_shared(config, "model.name", str(path))
    set_shared(config, "model.gguf_file", None)


def is_head(config: RLConfig) -> bool:
    """Whether this ``rl`` prepares ``output_dir``: the one that starts the orchestrator (node 0
    unless ``launch.processes`` says otherwise). The others touch nothing in it until their
    processes start, and write their own configs and logs under ``nodes/node-<rank>/``."""
    return "orchestrator" in {p.name for p in node_processes(config)}


def node_dir(config: RLConfig) -> Path:
    """The configs and logs of an ``rl`` that is not the head: ``<output_dir>/nodes/node-<rank>``
    on a trainer node, ``<output_dir>/nodes/<host name>`` on a node without trainer ranks."""
    if "trainer" in {p.name for p in node_processes(config)}:
        return config.output_dir / "nodes" / f"node-{config.launch.node_rank}"
    return config.output_dir / "nodes" / socket.gethostname()


def launch(config: RLConfig, argv: Sequence[str]) -> int:
    preflight(config)
    if not is_head(config):
        return _launch_node(config, argv)
    # One run per directory: taken before anything in it is read or deleted, held to the end.
    lock = lock_run_dir(config.output_dir, command="uv run rl " + shlex.join(argv))
    try:
        return _launch_locked(config, argv)
    finally:
        lock.release()


def _launch_node(config: RLConfig, argv: Sequence[str]) -> int:
    """A node that is not the head: its trainer ranks (and whatever ``launch.processes`` adds),
    with the head's ``output_dir`` as it is. Its ranks meet the head's in the rendezvous, which
    the head joins only once the directory is prepared, so nothing here races the head's
    clean-up; on ``--resume`` the trainer finds the newest complete checkpoint itself, and all
    ranks check that they resume from the same step."""
    if config.warmup.only:  # the head runs the warm-up alone
        print("rl: warmup.only: the node that runs the orchestrator runs the warm-up; nothing to do here")
        return 0
    here = node_dir(config)
    lock = lock_run_dir(here, command="uv run rl " + shlex.join(argv))  # one rl per node rank
    try:
        if config.warmup.enabled:  # the head runs the warm-up; this node trains its result
            _use_model(config, config.output_dir / "sft" / "final")
        specs = build_specs(config, write_resolved_configs(config, here / "configs"))
        names = ", ".join(spec.name for spec in specs)
        print(
            f"rl: {here.name}: starting {names}; output in "
            f"{config.output_dir} (prepared by the node that runs the orchestrator), logs in {here / 'logs'}",
            flush=True,
        )
        progress = Progress(config.output_dir / "metrics", config.max_steps, live=config.launch.progress)
        launcher = Launcher(
            specs,
            here / "logs",
            on_tick=progress.tick,
            health_timeout_s=config.launch.health_timeout_s,
            stop_timeout_s=config.launch.stop_timeout_s,
            poll_s=min(0.2, config.launch.refresh_s),
        )
        try:
            result = launcher.run()
        finally:
            progress.close()
        if result.exit_code != 0:
            print(f"rl: {here.name} stopped ({result.reason})", flush=True)
            return result.exit_code
        print(f"rl: {here.name} done", flush=True)
        return 0
    finally:
        lock.release()


def _launch_locked(config: RLConfig, argv: Sequence[str]) -> int:
    output_dir = config.output_dir
    resuming = config.ckpt.resume or config.ckpt.resume_step is not None
    if resuming:
        check_resumed_model(config)  # before anything is trimmed
        point = prepare_resume(output_dir, config.ckpt.resume_step, config.ckpt.parts)
        for step, reason in point.skipped:
            print(f"rl: skipping the checkpoint of step {step}: {reason}", flush=True)
        print(f"rl: resuming {output_dir} from step {point.step}", flush=True)
        # Every process resumes from exactly this step (the one that verified).
        set_shared(config, "ckpt.resume_step", point.step)
    else:
        prepare_fresh(output_dir, config.launch.overwrite, extra=("sft", "final", "eval", "teachers"))
    print(f"rl: output in {output_dir} (logs/, metrics/, configs/)", flush=True)
    remote.prepare_worker_tls(config)  # https:// remote workers: their certificate, pinned (launch/remote.py)
    paths = write_resolved_configs(config)
    from prime_composer.tracking import start_tracker

    tracker = start_tracker(config)  # [wandb]: one W&B run fed from metrics/*.jsonl; None without it
    exit_code = 1
    try:
        exit_code = _run_stages(config, argv, paths, tracker.tick if tracker else None)
    finally:
        if tracker is not None:
            tracker.finish(exit_code)
    return exit_code


def _run_stages(
    config: RLConfig, argv: Sequence[str], paths: dict[str, Path], track: Callable[..., None] | None
) -> int:
    """The warm-up (if any), then RL; ``track`` is called with the progress display."""
    remote.check(config)  # [transport.weights_origin]: refused before the warm-up, not after it
    output_dir = config.output_dir
    resuming = config.ckpt.resume or config.ckpt.resume_step is not None
    launch_kwargs: dict[str, Any] = {
        "health_timeout_s": config.launch.health_timeout_s,
        "stop_timeout_s": config.launch.stop_timeout_s,
        "poll_s": min(0.2, config.launch.refresh_s),
    }

    if config.warmup.enabled:
        specs, final = warmup_specs(config, paths)
        if not (resuming and (final / "config.json").exists()):
            print(f"rl: SFT warm-up ({config.warmup.max_steps} steps), log in logs/sft.log", flush=True)
            # One job after the other: sft reads the data sft-data writes.
            for spec in specs:
                result = Launcher([spec], output_dir / "logs", on_tick=track, **launch_kwargs).run()
                if result.exit_code != 0:
                    print(f"rl: warm-up failed ({result.reason})", flush=True)
                    return result.exit_code
        _use_model(config, final)
        paths = write_resolved_configs(config)

    # Local teachers ([teacher.pool.local]): fine-tuned now, served beside the run.
    data_jobs, sft_jobs = teachers.warmup_specs(config, paths.get("teacher", Path()), resuming)
    if sft_jobs:
        print(f"rl: warm-up of {len(sft_jobs)} local teachers, logs in logs/teacher-*.log", flush=True)
    for stage in [*([spec] for spec in data_jobs), *([sft_jobs] if sft_jobs else [])]:
        result = Launcher(stage, output_dir / "logs", on_tick=track, **launch_kwargs).run()
        if result.exit_code != 0:
            print(f"rl: teacher warm-up failed ({result.reason})", flush=True)
            return result.exit_code
    if config.warmup.only:
        if config.warmup.enabled:
            print(
                f"rl: warm-up done (warmup.only): {output_dir / 'sft' / 'final'}; RL starts from it with "
                f"--model.name {output_dir / 'sft' / 'final'} --warmup.enabled false",
                flush=True,
            )
        else:
            print("rl: local teachers' warm-up done (warmup.only)", flush=True)
        return 0
    teacher_servers = teachers.server_specs(config)  # fills in their base_url: write configs after
    if teacher_servers:
        paths = write_resolved_configs(config)

    origin = remote.start_weights_origin(config)  # remote inference workers' weights (launch/remote.py)
    progress = Progress(output_dir / "metrics", config.max_steps, live=config.launch.progress)

    preload: list[threading.Thread] = []

    def tick(statuses: dict[str, str]) -> None:
        if not preload:  # every process is up: the report's plotting library loads while they run
            preload.append(threading.Thread(target=_import_pyplot, name="report-preload", daemon=True))
            preload[0].start()
        progress.tick(statuses)
        if track is not None:
            track(statuses)

    launcher = Launcher(
        [*teacher_servers, *build_specs(config, paths)], output_dir / "logs", on_tick=tick, **launch_kwargs
    )
    try:
        result = launcher.run()
    finally:
        progress.close()
        if origin is not None:
            origin.close()
    if result.exit_code != 0:
        print(f"rl: run stopped ({result.reason}).{_resume_hint(config, argv, result)}", flush=True)
        return result.exit_code
    report = write_report_png(output_dir)
    if (output_dir / "final").is_dir():  # the trainer wrote it before the last eval was logged
        from prime_composer.trainer.model_card import write_model_card

        write_model_card(output_dir / "final", output_dir)
    print(summary(output_dir), flush=True)
    print(f"rl: done: {config.max_steps} steps; report: {report}", flush=True)
    return 0


def _import_pyplot() -> None:
    """Import what ``write_report_png`` draws with (~4 s on 2 busy cores, paid at the run's end
    otherwise): ``tick`` runs it in a thread once the run's processes are up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot


SUBCOMMANDS = {
    "migrate": "prime_composer.prime_rl.migrate",  # rl migrate prime-rl.toml: print it in our names
    "export": "prime_composer.trainer.export",  # rl export @ config.toml --checkpoint <dir>
    "envs": "prime_composer.orchestrator.env_ids",  # rl envs: the environments that can be loaded
    "certs": "prime_composer.launch.certs",  # rl certs --out DIR --host ADDR: a key, a cert, its pin
    "relay": "prime_composer.launch.relay",  # rl relay @ relay.toml: a weights or DiLoCo relay
}
"""``rl <name> ...``: the module whose ``main(argv)`` runs it."""


def main(argv: Sequence[str] | None = None) -> None:
    import importlib

    from prime_composer.config.cli import exit_process, run_entry_point

    argv_given = argv is not None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        code = importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    else:
        code = run_entry_point(
            RLConfig,
            lambda config: launch(config, argv),
            prog="rl",
            env_prefix=ENV_PREFIX,
            argv=argv,
            aliases=RL_ALIASES,
            finalize=finalize_rl_config,
            describe="Run inference, orchestrator and trainer together (see docs/architecture.md).",
            translate=PRIME_RL_NAMES,
            check=preflight,  # --dry-run runs every check that needs no process
        )
    if argv_given:  # called in-process (tests): the interpreter stays
        sys.exit(code)
    exit_process(code)


if __name__ == "__main__":
    main()

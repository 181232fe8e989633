"""``Sandbox.run``: one command in a workspace, isolated and limited, as a ``RunResult``.

A run is started by the fork server (``_init.py``, through ``spawn.Spawner``) from the run's spec:
command, environment, uid, rlimits and mounts, all decided here. ``spawn.watch`` then reads the
command's stdout and stderr (bounded, see ``output.py``) and the run's status lines until the run
ends, the wall-clock deadline passes or the output passes ``kill_output_bytes``; in the last two
cases the run's process group is SIGKILLed, which in isolated mode takes the whole pid namespace
with it. What the run hit is read from how it ended (signal, CPU time) and, for limits that only
make a call fail (memory, processes, open files), from the error text it printed.

A ``RunResult`` is data: a command that fails, crashes or times out is a normal result. Only a
failure of the sandbox itself (it could not set up the run) raises ``SandboxError``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prime_composer.config.sandbox import LimitsConfig, SandboxConfig
from prime_composer.sandbox import mounts
from prime_composer.sandbox.cgroups import CONTROLLERS, Cgroups, RunCgroup, RunLimits, RunUsage
from prime_composer.sandbox.output import Capture
from prime_composer.sandbox.server import ServerProcess
from prime_composer.sandbox.spawn import Spawner, SpawnError, watch
from prime_composer.sandbox.workspace import IdPool, Workspace

logger = logging.getLogger(__name__)

# Error texts that show a limit made a call fail (the process itself was not killed).
_LIMIT_MESSAGES: dict[str, tuple[str, ...]] = {
    "memory": ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory"),
    "processes": ("Resource temporarily unavailable", "BlockingIOError"),
    "open_files": ("Too many open files",),
    "file_size": ("File too large", "File size limit exceeded"),
    "disk": ("No space left on device", "Disk quota exceeded"),
}


class SandboxError(RuntimeError):
    """The sandbox itself failed (it could not set up or observe a run); not the command's fault."""


class IsolationUnavailable(SandboxError):
    """Isolation is impossible here and ``allow_unisolated`` is off."""


@dataclass(frozen=True)
class RunResult:
    """How one sandboxed command ended. Output strings are bounded (see ``LimitsConfig``)."""

    exit_code: int | None
    """The command's exit status; ``None`` when a signal ended it (see ``signal``)."""
    signal: str | None
    """Name of the signal that ended the command (``"SIGKILL"``), if one did."""
    stdout: str
    stderr: str
    duration_s: float
    """Wall time from start to the end of the run, sandbox set-up included."""
    timed_out: bool = False
    """The wall-clock limit passed and the run was killed."""
    killed_by: str | None = None
    """Which limit ended the run: ``timeout``, ``output``, ``cpu`` or ``file_size``; ``None`` if none did."""
    limits_hit: tuple[str, ...] = ()
    """Every limit the run ran into: the above plus ``output`` (output was cut), ``memory``,
    ``processes``, ``open_files`` and ``disk`` (read from the error text the command printed, and,
    for ``memory`` (an OOM kill), ``processes`` (a refused fork) and ``cpus`` (throttled), from the
    run's cgroup)."""
    stdout_bytes: int = 0
    """Bytes written to stdout in all (the string may hold fewer)."""
    stderr_bytes: int = 0
    cpu_s: float | None = None
    """CPU seconds of the command and the children it waited for."""
    max_rss_kb: int | None = None
    """Peak resident memory of the largest process (``getrusage``)."""
    peak_memory_mb: float | None = None
    """Peak memory of the whole run (its cgroup's, page cache included); ``None`` without cgroups."""
    isolated: bool = True
    """Whether the run was isolated (False only under ``allow_unisolated``)."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Status:
    """What ``_init`` reported."""

    exit_code: int | None = None
    signal: int | None = None
    cpu_s: float | None = None
    max_rss_kb: int | None = None
    exec_error: str | None = None
    setup_error: str | None = None

    def parse(self, data: bytes) -> None:
        for line in data.decode(errors="replace").splitlines():
            key, _, value = line.partition(" ")
            if key == "exit":
                self.exit_code = int(value)
            elif key == "signal":
                self.signal = int(value)
            elif key == "cpu_s":
                self.cpu_s = float(value)
            elif key == "max_rss_kb":
                self.max_rss_kb = int(value)
            elif key == "exec_error":
                self.exec_error = value
            elif key == "setup_error":
                self.setup_error = value


class Sandbox:
    """Runs commands in workspaces; one per process, shared by every episode.

    Creating it checks that isolation works here (a probe run); when it does not, it raises
    ``IsolationUnavailable``, or, with ``allow_unisolated``, logs a loud warning and runs
    commands unisolated.
    """

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config = config or SandboxConfig()
        is_root = os.geteuid() == 0
        self.root_dir = Path(config.root_dir or _default_root_dir(is_root))
        self.root_dir.mkdir(mode=0o711, parents=True, exist_ok=True)
        self.root_dir = self.root_dir.resolve()
        self._python_env = Path(config.python_env or sys.prefix)
        if not (self._python_env / "bin").is_dir():
            raise ValueError(
                f"sandbox.python_env: {str(self._python_env)!r} has no bin/ folder; "
                "point it at a venv or an installation prefix"
            )
        if is_root:  # unisolated, nothing is replaced
            self._check_root_dir()
        self._mounts = mounts.plan(
            system_paths=config.system_paths,
            python_env=self._python_env,
            exposed_paths=config.exposed_paths,
            hidden_paths=config.hidden_paths,
            private_tmp_paths=config.private_tmp_paths,
        )
        self._ids = IdPool(self.root_dir / ".uids", config.uid_base, config.num_uids)
        # Where a run mounts the tmpfs of its new root: any folder no visible path lies under will
        # do, as the mount exists only in the run's own mount namespace.
        self._new_root = self._ids.lock_dir
        self._ids.sweep(self.root_dir)
        self._cgroups = Cgroups(None, missing=dict.fromkeys(CONTROLLERS, "sandbox.cgroups is false"))
        if is_root and config.cgroups:
            self._cgroups = Cgroups.detect()
            self._cgroups.sweep()
        if is_root and self._cgroups.missing:
            logger.warning(
                "sandbox: whole-run limits without cgroups for %s (%s); those limits fall back to "
                "rlimits: memory per process (RLIMIT_AS), processes per workspace user (RLIMIT_NPROC), "
                "CPU time per process (RLIMIT_CPU)",
                ", ".join(sorted(self._cgroups.missing)),
                "; ".join(sorted(set(self._cgroups.missing.values()))),
            )
        self._executor = ThreadPoolExecutor(config.max_concurrent_runs, thread_name_prefix="sandbox")
        self._spawner = Spawner(config.seccomp_library if config.seccomp and is_root else None)
        self.isolated = False
        reason: str | None = "not running as root (uid separation and namespaces need it)"
        if is_root:
            reason = self._probe()
            self.isolated = reason is None
        if not self.isolated:
            if not config.allow_unisolated:
                self.close()
                raise IsolationUnavailable(
                    f"sandbox: cannot isolate commands here: {reason}. Run as root on Linux with "
                    "namespaces available (unshare) and libseccomp.so.2 installed (or set "
                    "sandbox.seccomp = false), or set sandbox.allow_unisolated = true to run "
                    "commands without isolation (trusted code only)."
                )
            logger.warning(
                "!!! SANDBOX IS NOT ISOLATED (%s): commands run as uid %d with network access, "
                "write access to everything this user can write, no process-count limit and no "
                "cleanup of processes that leave their process group; only rlimits, the timeout, "
                "the scrubbed environment and the working folder apply. sandbox.allow_unisolated "
                "is set; never do this with untrusted code. !!!",
                reason,
                os.geteuid(),
            )

        if self.isolated and not config.seccomp:
            logger.warning(
                "!!! SANDBOX WITHOUT SECCOMP: sandbox.seccomp is false, so sandboxed commands may "
                "create user namespaces, call ptrace, bpf, keyctl, io_uring, ... !!!"
            )

    # -- workspaces -----------------------------------------------------------------------

    def workspace(self, source: Path | str | None = None) -> Workspace:
        """A fresh workspace holding a copy of ``source`` (a folder), or an empty one."""
        return Workspace.create(
            self.root_dir,
            None if source is None else Path(source),
            self._ids,
            own_uid=self.isolated,
            disk_mb=self.config.workspace_disk_mb if self.isolated else None,
        )

    # -- running --------------------------------------------------------------------------

    def run(
        self,
        workspace: Workspace,
        command: Sequence[str] | str,
        *,
        limits: LimitsConfig | None = None,
        stdin: bytes | None = None,
        cwd: str = ".",
    ) -> RunResult:
        """Run ``command`` (an argv list, or a string for ``bash -c``) in ``workspace``.

        ``cwd`` is relative to the workspace. Never raises for anything the command does; raises
        ``SandboxError`` if the sandbox could not set the run up.
        """
        if workspace.closed:
            raise ValueError("sandbox: the workspace is closed")
        limits = limits or self.config.limits
        argv = ["/bin/bash", "-c", command] if isinstance(command, str) else list(command)
        if not argv:
            raise ValueError("sandbox: empty command")
        spec = self._spec(workspace, argv, limits, str(workspace.resolve(cwd)), isolate=self.isolated)
        return self._execute(spec, limits, stdin)

    async def run_async(
        self,
        workspace: Workspace,
        command: Sequence[str] | str,
        *,
        limits: LimitsConfig | None = None,
        stdin: bytes | None = None,
        cwd: str = ".",
    ) -> RunResult:
        """``run`` on the sandbox's thread pool (at most ``max_concurrent_runs`` at once)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, lambda: self.run(workspace, command, limits=limits, stdin=stdin, cwd=cwd)
        )

    def start(
        self,
        workspace: Workspace,
        command: Sequence[str],
        *,
        limits: LimitsConfig | None = None,
        cwd: str = ".",
    ) -> ServerProcess:
        """Start ``command`` in ``workspace`` as a run that is not waited for: a long-lived server
        whose stdin and stdout lines the caller uses (``sandbox/server.py``, for MCP stdio servers).

        The run is isolated and limited like ``run``'s, except that ``timeout_s`` does not apply
        (each call has the caller's deadline). The server is killed at ``workspace.close()`` at the
        latest. Raises ``SandboxError`` if the sandbox could not start it.
        """
        if workspace.closed:
            raise ValueError("sandbox: the workspace is closed")
        limits = limits or self.config.limits
        argv = list(command)
        if not argv:
            raise ValueError("sandbox: empty command")
        spec = self._spec(workspace, argv, limits, str(workspace.resolve(cwd)), isolate=self.isolated)
        spec, cgroup = self._with_cgroup(spec, limits, "server")
        try:
            pgid, pipes = self._spawner.spawn(spec, stdin=True)
        except (SpawnError, OSError) as e:
            if cgroup is not None:
                cgroup.finish()
            raise SandboxError(f"sandbox: {e}") from e
        server = ServerProcess(
            pgid,
            pipes,
            uid=workspace.uid if spec["isolate"] else None,
            cgroup=cgroup,
            max_line_bytes=limits.kill_output_bytes,
            stderr_bytes=limits.max_output_bytes,
        )
        workspace.at_close(server.close)
        return server

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The thread pool ``run_async`` uses (tools run their blocking work on it too)."""
        return self._executor

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._spawner.close()
        self._cgroups.close()

    @property
    def cgroup_controllers(self) -> tuple[str, ...]:
        """Controllers whose whole-run limits apply (``memory``, ``pids``, ``cpu``); the rest are rlimits."""
        return tuple(sorted(self._cgroups.parents))

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------

    def environment(self, workspace: Workspace) -> dict[str, str]:
        """The whole environment of a sandboxed command: fixed variables, nothing inherited."""
        env = {
            "PATH": ":".join([str(self._python_env / "bin"), *self.config.path]),
            "HOME": str(workspace.path),
            "TMPDIR": "/tmp" if self.isolated else str(workspace.tmp),
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "USER": "sandbox",
            "LOGNAME": "sandbox",
            "SHELL": "/bin/bash",
            "TERM": "dumb",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONNOUSERSITE": "1",
            "PIP_NO_INPUT": "1",
            # Thread pools sized to the machine's cores would run into max_processes (threads
            # count) on a large machine; sandboxed tests get one thread unless extra_env says more.
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        if (self._python_env / "pyvenv.cfg").is_file():
            env["VIRTUAL_ENV"] = str(self._python_env)
        env.update(self.config.extra_env)
        return env

    def _spec(
        self, workspace: Workspace, argv: list[str], limits: LimitsConfig, cwd: str, *, isolate: bool
    ) -> dict[str, Any]:
        mib = 2**20
        rlimits = [
            (resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1)),
            (resource.RLIMIT_AS, (limits.memory_mb * mib, limits.memory_mb * mib)),
            (resource.RLIMIT_FSIZE, (limits.max_file_mb * mib, limits.max_file_mb * mib)),
            (resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files)),
            (resource.RLIMIT_CORE, (0, 0)),
        ]
        # Per uid; unisolated, the uid is this process's own and shared with its processes. The
        # pids cgroup replaces it (both refuse the same fork; the cgroup's refusal is counted).
        if isolate and "pids" not in self._cgroups.parents:
            rlimits.append((resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes)))
        return {
            "argv": argv,
            "cwd": cwd,
            "env": self.environment(workspace),
            "isolate": isolate,
            "uid": workspace.uid if isolate else None,
            "gid": workspace.uid if isolate else None,
            "rlimits": rlimits,
            "umask": 0o022,
            "new_root": str(self._new_root),
            "mounts": mounts.for_workspace(self._mounts, workspace.path, workspace.tmp),
            "loopback": self.config.loopback,
            "seccomp": isolate and self.config.seccomp,
        }

    def _with_cgroup(
        self, spec: dict[str, Any], limits: LimitsConfig, what: str
    ) -> tuple[dict[str, Any], RunCgroup | None]:
        """``spec`` with a fresh cgroup of ``limits`` for an isolated run where cgroups are
        available, and that cgroup (None otherwise); the caller finishes it."""
        if not (spec["isolate"] and self._cgroups.available):
            return spec, None
        try:
            cgroup = self._cgroups.create(_run_limits(limits))
        except OSError as e:
            raise SandboxError(f"sandbox: cannot create the {what}'s cgroup: {e}") from e
        return {**spec, "cgroup_procs": cgroup.procs_files}, cgroup

    def _execute(self, spec: dict[str, Any], limits: LimitsConfig, stdin: bytes | None) -> RunResult:
        start = time.monotonic()
        spec, cgroup = self._with_cgroup(spec, limits, "run")
        stdout, stderr = Capture(limits.max_output_bytes), Capture(limits.max_output_bytes)
        try:
            try:
                pgid, pipes = self._spawner.spawn(spec, stdin=bool(stdin))
            except (SpawnError, OSError) as e:
                raise SandboxError(f"sandbox: {e}") from e
            status_lines, killed_by = watch(
                pgid,
                pipes,
                stdin,
                stdout,
                stderr,
                deadline=start + limits.timeout_s,
                kill_output_bytes=limits.kill_output_bytes,
            )
        finally:
            usage = cgroup.finish() if cgroup is not None else None
        duration = time.monotonic() - start
        status = _Status()
        status.parse(status_lines)
        if status.setup_error is not None:
            raise SandboxError(f"sandbox: setting up the run failed: {status.setup_error}")
        if status.exit_code is None and status.signal is None and killed_by is None:
            raise SandboxError("sandbox: the run ended without reporting how the command ended")
        if status.exec_error is not None:
            stderr.feed(f"sandbox: cannot execute {status.exec_error}\n".encode())
        return _result(status, stdout, stderr, killed_by, limits, duration, usage, isolated=spec["isolate"])

    def _probe(self) -> str | None:
        """``None`` if an isolated run works here, else why not."""
        try:
            with Workspace.create(self.root_dir, None, self._ids, own_uid=True) as workspace:
                spec = self._spec(
                    workspace, ["/bin/true"], self.config.limits, str(workspace.path), isolate=True
                )
                result = self._execute(spec, self.config.limits, None)
        except (SandboxError, OSError) as e:
            return str(e)
        if result.exit_code != 0:
            return f"a probe run of /bin/true ended with {result.exit_code or result.signal}: {result.stderr}"
        return None

    def _check_root_dir(self) -> None:
        root = str(self.root_dir)
        for covered in self.config.private_tmp_paths:
            real = os.path.realpath(covered)
            if root == real or root.startswith(real + "/"):
                raise ValueError(
                    f"sandbox.root_dir {root!r} lies under {real!r}, which is replaced inside the "
                    "sandbox by the workspace's own tmp; choose a root_dir elsewhere"
                )


def _result(
    status: _Status,
    stdout: Capture,
    stderr: Capture,
    killed_by: str | None,
    limits: LimitsConfig,
    duration: float,
    usage: RunUsage | None,
    *,
    isolated: bool,
) -> RunResult:
    signame = signal.Signals(status.signal).name if status.signal is not None else None
    if killed_by is not None and status.exit_code is None:
        signame = signame or "SIGKILL"
    cpu_exhausted = status.cpu_s is not None and status.cpu_s >= limits.cpu_s - 0.05
    if killed_by is None and (signame == "SIGXCPU" or (signame == "SIGKILL" and cpu_exhausted)):
        killed_by = "cpu"
    elif killed_by is None and signame == "SIGXFSZ":
        killed_by = "file_size"
    hit = [killed_by] if killed_by is not None else []
    if (stdout.truncated or stderr.truncated) and "output" not in hit:
        hit.append("output")
    error_text = stderr.text()
    if usage is not None:  # what the cgroup counted, whether or not the command said so
        for name, count in (
            ("memory", usage.oom_kills),
            ("processes", usage.refused_forks),
            ("cpus", usage.throttled_periods),
        ):
            if count and name not in hit:
                hit.append(name)
    if status.exit_code != 0:
        for name, messages in _LIMIT_MESSAGES.items():
            if name not in hit and any(m in error_text for m in messages):
                hit.append(name)
    return RunResult(
        exit_code=status.exit_code if killed_by not in ("timeout", "output") else None,
        signal=signame,
        stdout=stdout.text(),
        stderr=error_text,
        duration_s=duration,
        timed_out=killed_by == "timeout",
        killed_by=killed_by,
        limits_hit=tuple(hit),
        stdout_bytes=stdout.num_bytes,
        stderr_bytes=stderr.num_bytes,
        cpu_s=status.cpu_s,
        max_rss_kb=status.max_rss_kb,
        peak_memory_mb=None
        if usage is None or usage.peak_memory_bytes is None
        else usage.peak_memory_bytes / 2**20,
        isolated=isolated,
    )


def _run_limits(limits: LimitsConfig) -> RunLimits:
    return RunLimits(
        memory_bytes=None if limits.run_memory_mb is None else limits.run_memory_mb * 2**20,
        # The run's two set-up processes (outer, init) are in the cgroup too.
        max_tasks=limits.max_processes + 2,
        cpus=limits.cpus,
    )


def _default_root_dir(is_root: bool) -> Path:
    if is_root:
        return Path("/var/lib/prime-composer/sandbox")
    return Path(tempfile.gettempdir()) / "prime-composer-sandbox"

"""Config of the sandbox that runs untrusted code (tool calls, tests) and of the coding tools on it.

``SandboxConfig`` says where workspaces live, how a run is isolated and which limits a run gets;
``LimitsConfig`` is one set of per-run limits (tool calls and test runs get their own);
``ToolsConfig`` says which tools an environment exposes and how much output the model sees.
The mechanism behind these fields is described in ``prime_composer.sandbox``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from prime_composer.config.base import BaseConfig

ToolName = Literal["list_files", "read_file", "search", "write_file", "edit_file", "run", "run_tests"]
"""Names of the tools ``prime_composer.sandbox.tools`` implements."""

ALL_TOOLS: tuple[ToolName, ...] = (
    "list_files",
    "read_file",
    "search",
    "write_file",
    "edit_file",
    "run",
    "run_tests",
)


SYSTEM_PATHS = (
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    *(
        f"/etc/{name}"
        for name in (
            "ld.so.cache",
            "ld.so.conf",
            "ld.so.conf.d",
            "passwd",
            "group",
            "nsswitch.conf",
            "hosts",
            "host.conf",
            "localtime",
            "timezone",
            "ssl",
            "ca-certificates",
            "alternatives",
            "mime.types",
            "os-release",
            "debian_version",
            "bash.bashrc",
            "profile",
            "inputrc",
            "locale.alias",
            "magic",
            "protocols",
            "services",
            "shells",
            "terminfo",
        )
    ),
)
"""The default ``SandboxConfig.system_paths``: programs, libraries and the few files of ``/etc``
the C library, shells and Python read (no package-manager or tool configs, which may hold tokens)."""


class LimitsConfig(BaseConfig):
    """Limits of one sandboxed run; a run that hits one is stopped or fails, and its result says which."""

    timeout_s: float = Field(default=30.0, gt=0)
    """Wall-clock limit; the whole process tree is killed when it passes."""

    cpu_s: int = Field(default=30, ge=1)
    """CPU seconds per process (``RLIMIT_CPU``): SIGXCPU at the limit, SIGKILL one second later."""

    memory_mb: int = Field(default=2048, ge=16)
    """Address space per process in MiB (``RLIMIT_AS``); allocations beyond it fail. It counts
    reserved, not resident, memory: programs that map large regions up front (CUDA libraries,
    JAX) need more than they use."""

    run_memory_mb: int | None = Field(default=4096, ge=16)
    """Memory of the whole run in MiB: every process of it together, page cache and tmpfs files
    included (the run's cgroup: ``memory.max`` or v1 ``memory.limit_in_bytes``); past it the
    kernel's OOM killer kills one of the run's processes. ``None``: no whole-run limit. Without
    cgroups only ``memory_mb`` per process holds."""

    cpus: float | None = Field(default=2.0, gt=0)
    """CPU bandwidth of the whole run in cores (the cgroup's CPU quota per 100 ms period); a run
    that wants more is throttled, not killed. ``None``: no limit."""

    max_processes: int = Field(default=64, ge=1)
    """Processes and threads of the run at once (the run's ``pids`` cgroup; ``RLIMIT_NPROC`` of the
    workspace's user where no pids cgroup is available); ``fork`` beyond it fails. Enforced only
    in isolated mode."""

    max_file_mb: int = Field(default=64, ge=1)
    """Largest file a process may write, in MiB (``RLIMIT_FSIZE``); writing past it kills it (SIGXFSZ)."""

    max_open_files: int = Field(default=256, ge=16)
    """Open file descriptors per process (``RLIMIT_NOFILE``)."""

    max_output_bytes: int = Field(default=65536, ge=256)
    """Bytes of stdout and of stderr kept per run (the first and last halves); the rest is replaced
    by a marker saying how many bytes were cut."""

    kill_output_bytes: int = Field(default=16 * 2**20, ge=1024)
    """Total bytes a run may write to stdout + stderr before it is killed (an endless writer would
    otherwise run until ``timeout_s``)."""

    @model_validator(mode="after")
    def _check_output(self) -> LimitsConfig:
        if self.kill_output_bytes < self.max_output_bytes:
            raise ValueError(
                f"kill_output_bytes ({self.kill_output_bytes}) is below max_output_bytes "
                f"({self.max_output_bytes}); raise kill_output_bytes or lower max_output_bytes"
            )
        return self


class SandboxConfig(BaseConfig):
    """Where workspaces live and how each run is isolated."""

    root_dir: Path | None = None
    """Folder holding one sub-folder per workspace; ``None`` is ``/var/lib/prime-composer/sandbox``
    when running as root, else ``<tmp>/prime-composer-sandbox``. Inside, only the run's own
    workspace is visible, at its own path. It must not lie under ``private_tmp_paths`` (those
    are the workspace's tmp inside)."""

    allow_unisolated: bool = False
    """Run anyway when isolation is impossible (not root, or no namespaces): commands then run as
    this user with the network, rlimits only and no process-count limit. Only for trusted code;
    a loud warning is logged."""

    workspace_disk_mb: int | None = Field(default=1024, ge=1)
    """Disk quota of each workspace in MiB: its folder is a tmpfs of this size (in memory, and
    charged to the runs that write it), shared by ``work/`` and the private ``/tmp``; a write past
    it fails with ENOSPC. Isolated mode only. ``None``: the workspace lives on ``root_dir``'s disk,
    limited only by ``max_file_mb`` per file."""

    cgroups: bool = True
    """Hold each run in a cgroup of its own (v2 where it offers ``memory``, ``pids`` and ``cpu``,
    else v1) for the whole-run limits ``run_memory_mb``, ``max_processes`` and ``cpus``. Where
    cgroups are unavailable (or with ``false``) the sandbox says so at start and those limits
    fall back to rlimits."""

    seccomp: bool = True
    """Load a seccomp filter into every sandboxed command (``sandbox/_seccomp.py``): new namespaces
    (``unshare``, ``clone`` with namespace flags, ``setns``), mounts, ``ptrace``, ``bpf``,
    ``keyctl``, ``io_uring``, ... fail with EPERM. Needs ``seccomp_library``; without it the
    sandbox refuses to start. ``false`` runs without the filter (a loud warning is logged)."""

    seccomp_library: str = "libseccomp.so.2"
    """The libseccomp shared library (a soname the dynamic loader finds, or a path)."""

    loopback: bool = True
    """Bring up the loopback interface inside the sandbox's empty network namespace, so tests can
    use 127.0.0.1 between their own processes; nothing outside the run is reachable either way."""

    uid_base: int = Field(default=2_000_000, ge=1000)
    """First user id given to workspaces (isolated mode); each live workspace gets its own, which
    is what makes ``max_processes`` per workspace. Ids need no ``/etc/passwd`` entry."""

    num_uids: int = Field(default=4096, ge=1)
    """Size of the user id range, i.e. the most workspaces alive at once on this machine."""

    system_paths: list[Path] = Field(default_factory=lambda: [Path(p) for p in SYSTEM_PATHS])
    """The system's runtime, visible read-only inside (paths that do not exist are skipped). The
    sandbox shows only these, the Python environment, ``exposed_paths`` and the workspace: project
    checkouts, caches, ``/opt``, ``/srv``, ``/var``, home folders and every other folder of the
    host are absent."""

    hidden_paths: list[Path] = Field(default_factory=list)
    """Folders inside what is visible (``system_paths``, the Python environment, ``exposed_paths``)
    covered by an empty read-only folder, e.g. a copy of a project under ``/usr/lib``. The Python
    environment itself stays visible even under a hidden folder."""

    exposed_paths: list[Path] = Field(default_factory=list)
    """More folders visible read-only inside, at the same path. The Python environment
    (``python_env`` and its base interpreter) is always visible."""

    private_tmp_paths: list[Path] = Field(
        default_factory=lambda: [Path("/tmp"), Path("/var/tmp"), Path("/dev/shm")]
    )
    """Temporary folders that are the workspace's own ``tmp/`` inside, so episodes cannot see each
    other's files. A Python environment under one of them (a venv under ``/tmp``) is bound over it."""

    python_env: Path | None = None
    """Python environment (a venv or an installation prefix) whose ``bin`` comes first on ``PATH``
    inside the sandbox, so ``python -m pytest`` uses it; ``None`` is the environment running this
    process (``sys.prefix``)."""

    path: list[str] = Field(default_factory=lambda: ["/usr/local/bin", "/usr/bin", "/bin"])
    """Folders on ``PATH`` after ``<python_env>/bin``."""

    extra_env: dict[str, str] = Field(default_factory=dict)
    """Variables added to the sandbox's fixed minimal environment (never secrets: the sandboxed
    code can read them). Nothing else is inherited from this process."""

    max_concurrent_runs: int = Field(default=16, ge=1)
    """Runs at once through ``Sandbox.run_async`` (a thread pool of this size)."""

    limits: LimitsConfig = LimitsConfig()
    """Limits of one tool call (``run``, ``search``)."""

    test_limits: LimitsConfig = LimitsConfig(timeout_s=300.0, cpu_s=300, max_processes=256)
    """Limits of one test run (``run_tests``)."""

    @model_validator(mode="after")
    def _check_paths(self) -> SandboxConfig:
        if self.root_dir is not None:
            root = Path(self.root_dir)
            if not root.is_absolute():
                raise ValueError(f"root_dir must be an absolute path, got {str(root)!r}")
            for covered in self.private_tmp_paths:
                if root == covered or covered in root.parents:
                    raise ValueError(
                        f"root_dir {str(root)!r} lies under private_tmp_paths entry {str(covered)!r}, "
                        "which is replaced inside the sandbox; choose a root_dir elsewhere"
                    )
        for field in ("system_paths", "hidden_paths", "exposed_paths", "private_tmp_paths"):
            for path in getattr(self, field):
                if not Path(path).is_absolute():
                    raise ValueError(f"{field} entries must be absolute paths, got {str(path)!r}")
        if self.uid_base + self.num_uids > 2**32 - 2:
            raise ValueError("uid_base + num_uids must stay below 2**32 - 1")
        return self


class ToolsConfig(BaseConfig):
    """Which coding tools an environment exposes and how much of their output the model sees."""

    enabled: list[ToolName] = Field(default_factory=lambda: list(ALL_TOOLS))
    """Tools offered to the model, in this order."""

    max_result_bytes: int = Field(default=16384, ge=256)
    """Bytes of one tool result the model sees; longer results keep their first and last halves
    around a marker saying how much was cut."""

    max_read_lines: int = Field(default=500, ge=1)
    """Most lines ``read_file`` returns in one call (the model pages with ``start_line``)."""

    max_list_entries: int = Field(default=1000, ge=1)
    """Most paths ``list_files`` returns."""

    max_search_matches: int = Field(default=200, ge=1)
    """Most matching lines ``search`` returns."""

    list_skip_dirs: list[str] = Field(
        default_factory=lambda: [".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"]
    )
    """Folder names whose contents ``list_files`` and ``search`` leave out."""

    @model_validator(mode="after")
    def _check_enabled(self) -> ToolsConfig:
        if len(set(self.enabled)) != len(self.enabled):
            raise ValueError(f"enabled lists a tool twice: {self.enabled}")
        return self

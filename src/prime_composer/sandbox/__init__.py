"""Running untrusted code (agent tool calls, tests of coding tasks): workspaces, isolated runs, tools.

Use::

    sandbox = Sandbox(SandboxConfig())              # one per process; probes isolation
    with sandbox.workspace(task_dir) as ws:         # a fresh copy of the task's files
        tools = Toolset(sandbox, ws, ToolsConfig(), test_command="python -m pytest -q")
        request["tools"] = tools.definitions()      # OpenAI tools format
        result = tools.call(name, arguments_json)   # -> ToolResult(content, record); never raises
        run = sandbox.run(ws, ["python", "-m", "pytest"], limits=sandbox.config.test_limits)

How a run is isolated (isolated mode: running as root on Linux; measured on the development
machines, kernel 6.18, cgroup v1, no container engine):

- **Deny by default** (``mounts.py``): each run's init builds a new root on an empty tmpfs and
  ``pivot_root``s into it, so only an allowlist exists inside: the system runtime
  (``system_paths``: ``/usr``, ``/bin``, ``/lib*``, a few files of ``/etc``), the Python
  environment and its base interpreter (read-only), ``exposed_paths``, a few device nodes, a
  fresh ``/proc``, the workspace at its own path and its ``tmp/`` on ``/tmp``, ``/var/tmp`` and
  ``/dev/shm``. Project checkouts, environment sources and answer keys, caches, ``/opt``,
  ``/srv``, ``/var``, home folders and other workspaces are not there at all. ``hidden_paths``
  covers folders inside the allowlist. A Python environment under a private tmp (a venv under
  ``/tmp``) or a hidden folder is bound over it, so ``python`` is always there.
- **No network**: a new network namespace per run, with only a loopback interface (brought up
  so a test can talk to itself; ``loopback = false`` leaves it down). New mount, pid, IPC and UTS
  namespaces come with it.
- **An unprivileged user per workspace**: commands run as a uid of their own
  (``uid_base + k``, held by a lock file for the workspace's life), no groups, ``no_new_privs``
  (setuid binaries do not elevate). Root would ignore every file permission; a uid per workspace
  keeps concurrent episodes out of each other's folders (0700).
- **No new namespaces** (``_seccomp.py``): a seccomp filter, through the system's
  ``libseccomp.so.2``, refuses ``unshare``/``clone`` with namespace flags, ``setns``, mounts,
  ``ptrace``, ``bpf``, ``keyctl``, ``io_uring``, ... (EPERM). Without libseccomp the sandbox
  refuses to start unless ``seccomp = false``.
- **Whole-run limits** (``cgroups.py``): each run is a cgroup of its own (v2 where it offers the
  controllers, else v1): ``run_memory_mb`` for all its processes together (OOM kill past it),
  ``max_processes`` (pids) and ``cpus`` (CPU bandwidth); its folders are removed after the run.
  Each workspace is a tmpfs of ``workspace_disk_mb`` (work and tmp together). Per process:
  ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, no core dumps; plus a
  wall-clock timeout and a cap on output bytes (kept and killed-at, ``LimitsConfig``). Where
  cgroups are unavailable the sandbox says so at start and falls back to rlimits
  (``RLIMIT_NPROC`` per workspace uid; memory only per process).
- **No orphans**: the command's tree lives in its own pid namespace, whose init exits when the
  command does; the kernel then kills everything left (a ``sleep`` grandchild, a daemon, a fork
  bomb). On timeout the run's process group is SIGKILLed, and every sandbox process asks for
  SIGKILL when its parent dies, so a crash of this process kills its runs too. The one run
  that outlives a call, ``Sandbox.start`` (``server.py``, an MCP stdio server kept for an
  episode), is SIGSTOPped between its calls and killed by ``Workspace.close``.
- **A scrubbed environment**: a fixed set of variables (``Sandbox.environment``: PATH with the
  Python environment's ``bin`` first, HOME = the workspace, TMPDIR, LANG, PYTHONDONTWRITEBYTECODE,
  one BLAS/OpenMP thread, ...) plus ``extra_env``; nothing is inherited, so API keys never reach sandboxed code, and the
  pid namespace hides other processes' ``/proc/<pid>/environ``.

Why this and not the alternatives: there is no container engine here; a user namespace alone
would still leave root's files writable. ``RLIMIT_AS`` counts address space, not resident
memory (a program that maps much more than it touches needs a larger ``memory_mb``); the
cgroup's ``run_memory_mb`` is what bounds resident memory. Runs start from a fork server
(``_init.py``, stdlib only, started once per ``Sandbox``), so a call costs a few forks, not an
interpreter start-up (~15 ms); ``bench/agentic.py`` measures the overhead against the bare command.

Python in the sandbox: ``python`` on ``PATH`` is the project's environment (``sys.prefix``, or
``SandboxConfig.python_env``), so ``python -m pytest`` works with the project's pytest. The
environment is read-only inside, so Python cannot write bytecode caches there: a venv made with
``uv sync --compile-bytecode`` starts much faster in the sandbox.

Fallback: when isolation is impossible (not root, namespaces refused, no libseccomp), ``Sandbox()`` raises
``IsolationUnavailable`` unless ``allow_unisolated = true``; then it logs a loud warning and runs
commands as this process's user with rlimits (no process-count limit), the timeout, the scrubbed
environment and the workspace as cwd, but with the network, without uid separation, and without
killing processes that leave the run's process group.
"""

from prime_composer.sandbox.sandbox import IsolationUnavailable, RunResult, Sandbox, SandboxError
from prime_composer.sandbox.tools import ToolCallRecord, ToolResult, Toolset, format_run
from prime_composer.sandbox.workspace import PathOutsideWorkspace, Workspace

__all__ = [
    "IsolationUnavailable",
    "PathOutsideWorkspace",
    "RunResult",
    "Sandbox",
    "SandboxError",
    "ToolCallRecord",
    "ToolResult",
    "Toolset",
    "Workspace",
    "format_run",
]

"""The sandbox's fork server: starts each run's process tree (stdlib only, no package imports).

``Sandbox`` starts this script once, as ``python -I -S _init.py SOCK_FD [SECCOMP_LIBRARY]`` (as root in isolated
mode), and keeps it for its lifetime: a fork server, so a run costs a ``fork`` of this small,
already warm process instead of a new interpreter (~15 ms) per call. One request on the
``SOCK_SEQPACKET`` socket carries five file descriptors: a memfd holding the run's spec (a
``marshal``-ed dict from the parent), the command's stdin, stdout and stderr, and a pipe on which
the run reports what happened, one ``key value`` line per fact. The server forks ``outer`` and
replies with its pid (the run's process group, which the parent SIGKILLs on timeout). The server
ignores SIGCHLD (the kernel reaps its children) and exits when the socket closes, i.e. when the
parent is gone; its children then die with it (below).

Isolated mode, below the server::

    outer                    new session; join the run's cgroups; unshare(mount, net, pid, ipc,
                             uts); fork; wait; exit
      └─ init (pid 1)        a new root of only what ``mounts.py`` lists, pivot_root; lo up;
                             fork; reap every child until the command ends; report; exit,
                             which makes the kernel SIGKILL whatever is left in the namespace
           └─ command        rlimits, drop to the workspace's uid (no groups, no_new_privs),
                             umask, chdir, the seccomp filter (``_seccomp.py``: no new
                             namespaces, no mount, ptrace, bpf, ...), exec with the spec's
                             environment

``outer`` and ``init`` ask for SIGKILL when their parent dies, so the death of the server or of
``outer`` tears the whole namespace down.

Unisolated mode: ``outer`` forks the command (same process group), waits, reports, and SIGKILLs
its own process group, which takes the command's children with it. A child that starts its own
session escapes; that is one of the things unisolated mode does not enforce.
"""

import _signal as signal  # not `signal`: its enum import costs ~8 ms of start-up per run
import marshal
import os
import resource
import sys

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1


class SetupError(Exception):
    pass


_filter = None
_filter_error = "the fork server was started without a seccomp library"


def main() -> None:
    global _filter, _filter_error
    import socket

    libc = _libc()
    server = socket.socket(fileno=int(sys.argv[1]))
    if len(sys.argv) > 2:  # build the filter once; every command loads it
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        try:
            import _seccomp

            _filter = _seccomp.Filter(sys.argv[2])
        except OSError as e:
            _filter_error = f"cannot use {sys.argv[2]}: {e}"
    server_pid = os.getpid()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps finished runs
    while True:
        try:
            _, fds, _, _ = socket.recv_fds(server, 16, 8)
        except OSError:
            break
        if not fds:  # end of file: the parent is gone
            break
        reply = f"error: expected 5 file descriptors, got {len(fds)}"
        if len(fds) == 5:
            try:
                pid = os.fork()
            except OSError as e:
                pid, reply = -1, f"error: fork: {e}"
            if pid == 0:
                try:
                    server.close()
                    _outer(libc, fds, server_pid)
                finally:
                    os._exit(1)  # never back into the server loop
            if pid > 0:
                reply = str(pid)
        for fd in fds:
            os.close(fd)
        try:
            server.send(reply.encode())
        except OSError:
            break


def _outer(libc, fds: list[int], server_pid: int) -> None:
    """A run's top process (see the module docstring); never returns."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    spec_fd, stdin_fd, stdout_fd, stderr_fd, status_fd = fds
    try:
        os.setsid()
        _die_with_parent(libc, server_pid)
        for fd, target in ((stdin_fd, 0), (stdout_fd, 1), (stderr_fd, 2)):
            os.dup2(fd, target)
            os.close(fd)
        with os.fdopen(spec_fd, "rb") as f:
            spec = marshal.loads(f.read())
        for procs in spec.get("cgroup_procs", ()):  # before any fork: the whole run is inside
            fd = os.open(procs, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, str(os.getpid()).encode())
            finally:
                os.close(fd)
    except (OSError, SetupError, ValueError) as e:
        _report(status_fd, "setup_error", f"starting the run: {e}")
        os._exit(1)
    if not spec["isolate"]:
        command_pid = _start_command(libc, spec, status_fd)
        _wait_command(command_pid, status_fd, reap_others=False)
        os.killpg(0, signal.SIGKILL)  # the command's children (same process group), and this process
    try:
        _check(
            libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS), "unshare"
        )
    except SetupError as e:
        _report(status_fd, "setup_error", str(e))
        os._exit(1)
    # The child cannot see this process (it is outside its pid namespace), so it learns whether
    # this process is still alive from a pipe whose write end only this process holds.
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        _ns_init(libc, spec, status_fd, alive_r)
    os.close(alive_r)
    os.close(status_fd)
    os.waitpid(pid, 0)
    os._exit(0)


def _ns_init(libc, spec: dict, status_fd: int, alive_r: int) -> None:
    """PID 1 of the new namespaces: set up the mounts and the network, start the command, reap."""
    try:
        _check(libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0), "prctl(PDEATHSIG)")
        os.set_blocking(alive_r, False)
        try:
            os.read(alive_r, 1)
            os._exit(1)  # end of file: the parent died before the request took effect
        except BlockingIOError:
            os.close(alive_r)
        _setup_mounts(libc, spec)
        if spec["loopback"]:
            _loopback_up(libc)
        hostname = b"sandbox"
        _check(libc.sethostname(hostname, len(hostname)), "sethostname")
    except (SetupError, OSError) as e:
        _report(status_fd, "setup_error", str(e))
        os._exit(1)
    command_pid = _start_command(libc, spec, status_fd)
    _wait_command(command_pid, status_fd, reap_others=True)
    os._exit(0)


def _setup_mounts(libc, spec: dict) -> None:
    """Build the run's root from ``spec["mounts"]`` (see ``mounts.py``) on a tmpfs and pivot into it."""
    new = spec["new_root"]
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    _mount(libc, "tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    tmpfs = [new]  # remounted read-only once everything is mounted in them
    for kind, target, source in spec["mounts"]:
        dest = new + target
        if kind == "symlink":
            if not os.path.lexists(dest):
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                os.symlink(source, dest)
        elif kind == "proc":
            os.makedirs(dest, exist_ok=True)
            _mount(libc, "proc", dest, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        elif kind == "hide":
            _mount(libc, "tmpfs", dest, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=755")
            tmpfs.append(dest)
        else:  # ro, rw, dev: a bind mount
            if os.path.isdir(source):
                os.makedirs(dest, exist_ok=True)
            elif not os.path.lexists(dest):
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                os.close(os.open(dest, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))
            _mount(libc, source, dest, None, MS_BIND | MS_REC)
            flags = MS_REMOUNT | MS_BIND | MS_NOSUID
            flags |= MS_RDONLY | MS_NODEV if kind == "ro" else MS_NODEV if kind == "rw" else 0
            _mount(libc, None, dest, None, flags)
    for dest in reversed(tmpfs):
        _mount(libc, None, dest, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(new)
    _check(libc.syscall(SYS_PIVOT_ROOT[os.uname().machine], b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "umount the host's root")
    os.chdir("/")


def _start_command(libc, spec: dict, status_fd: int) -> int:
    parent_pid = os.getpid()
    pid = os.fork()
    if pid != 0:
        return pid
    try:
        os.set_inheritable(status_fd, False)
        if not spec["isolate"]:  # isolated, the namespace's end does this
            _die_with_parent(libc, parent_pid)
        for name, value in spec["rlimits"]:
            resource.setrlimit(name, value)
        if spec["uid"] is not None:
            os.setgroups([])
            os.setresgid(spec["gid"], spec["gid"], spec["gid"])
            os.setresuid(spec["uid"], spec["uid"], spec["uid"])
            _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
        os.umask(spec["umask"])
        # Python ignores these; an ignored signal stays ignored across exec, and a command must
        # die of SIGPIPE / SIGXFSZ like it would from a shell.
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(spec["cwd"])
        if spec.get("seccomp"):
            if _filter is None:
                raise SetupError(f"seccomp: {_filter_error}")
            _filter.load()  # the last step before exec: nothing below may need what it refuses
    except Exception as e:
        _report(status_fd, "setup_error", f"preparing the command: {e}")
        os._exit(126)
    argv = spec["argv"]
    try:
        os.execvpe(argv[0], argv, spec["env"])
    except OSError as e:
        _report(status_fd, "exec_error", f"{argv[0]}: {e.strerror}")
        os._exit(127)
    raise AssertionError("unreachable")


def _wait_command(command_pid: int, status_fd: int, *, reap_others: bool) -> None:
    while True:
        try:
            pid, status, usage = os.wait4(-1 if reap_others else command_pid, 0)
        except ChildProcessError:
            _report(status_fd, "setup_error", "lost track of the command")
            return
        if pid != command_pid:
            continue  # an orphan re-parented to pid 1
        if os.WIFSIGNALED(status):
            _report(status_fd, "signal", str(os.WTERMSIG(status)))
        else:
            _report(status_fd, "exit", str(os.WEXITSTATUS(status)))
        _report(status_fd, "cpu_s", repr(usage.ru_utime + usage.ru_stime))
        _report(status_fd, "max_rss_kb", str(usage.ru_maxrss))
        return


def _report(status_fd: int, key: str, value: str) -> None:
    os.write(status_fd, f"{key} {value.replace(chr(10), ' ')}\n".encode())


def _libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_char_p]
    libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    return libc


def _check(result: int, what: str) -> None:
    if result != 0:
        import ctypes

        errno = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(errno)} (errno {errno})")


def _mount(libc, source, target: str, fstype, flags: int, data=None) -> None:
    encode = lambda s: None if s is None else s.encode()  # noqa: E731
    result = libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data))
    _check(result, f"mount {target}")


def _die_with_parent(libc, parent_pid: int) -> None:
    _check(libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0), "prctl(PDEATHSIG)")
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def _loopback_up(libc) -> None:
    import ctypes

    sock = libc.socket(2, 2, 0)  # AF_INET, SOCK_DGRAM: any socket takes interface ioctls
    if sock < 0:
        _check(sock, "socket")
    try:
        # struct ifreq: the interface name in 16 bytes, then a union whose short flags come first.
        ifreq = ctypes.create_string_buffer(b"lo", 40)
        _check(libc.ioctl(sock, SIOCGIFFLAGS, ifreq), "ioctl(SIOCGIFFLAGS)")
        flags = int.from_bytes(ifreq.raw[16:18], "little") | IFF_UP
        ifreq = ctypes.create_string_buffer(ifreq.raw[:16] + flags.to_bytes(2, "little") + ifreq.raw[18:], 40)
        _check(libc.ioctl(sock, SIOCSIFFLAGS, ifreq), "ioctl(SIOCSIFFLAGS)")
    finally:
        os.close(sock)


if __name__ == "__main__":
    main()

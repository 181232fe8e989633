"""Starting a run through the fork server (``_init.py``) and watching it until it ends.

``Spawner`` owns the fork server: it starts it, sends it one request per run (the spec in a memfd
and the run's pipes), and restarts it once if it died. ``watch`` feeds the run's stdin, collects
its stdout and stderr into bounded ``Capture``s and its status lines, and SIGKILLs the run's
process group when the wall-clock deadline passes or the output passes ``kill_output_bytes``.
"""

from __future__ import annotations

import contextlib
import marshal
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prime_composer.sandbox.output import Capture

INIT_SCRIPT = Path(__file__).with_name("_init.py")

KILL_GRACE_S = 2.0
"""How long to keep reading after the run was killed or reported its end. In isolated mode every
writer is gone within moments; unisolated, a process that left the run's process group may hold
the pipes open, and this bounds the wait for it."""


class SpawnError(RuntimeError):
    """The fork server could not start a run."""


@dataclass
class Pipes:
    """The parent's ends of one run's pipes."""

    stdin: int | None
    stdout: int
    stderr: int
    status: int


class Spawner:
    """The fork server process and the socket to it; ``spawn`` is safe to call from many threads."""

    def __init__(self, seccomp_library: str | None = None) -> None:
        self._seccomp_library = seccomp_library
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._start()

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    "-S",
                    str(INIT_SCRIPT),
                    str(theirs.fileno()),
                    *([self._seccomp_library] if self._seccomp_library else []),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,  # a Ctrl-C in the terminal reaches us, not it
                env={},
                cwd="/",
            )
        except OSError as e:
            ours.close()
            raise SpawnError(f"cannot start the sandbox's fork server: {e}") from e
        finally:
            theirs.close()
        self._sock = ours
        self._owner_pid = os.getpid()

    def spawn(self, spec: dict[str, Any], stdin: bool) -> tuple[int, Pipes]:
        """Start a run; returns its process group id and the parent's ends of its pipes."""
        theirs: list[int] = []  # sent to the server, then closed here
        ours: list[int] = []
        try:
            spec_fd = os.memfd_create("sandbox-spec", os.MFD_CLOEXEC)
            theirs.append(spec_fd)
            os.write(spec_fd, marshal.dumps(spec))
            os.lseek(spec_fd, 0, os.SEEK_SET)
            if stdin:
                stdin_r, stdin_w = os.pipe()
                theirs.append(stdin_r)
                ours.append(stdin_w)
            else:
                theirs.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            for _ in range(3):  # stdout, stderr, status
                read_end, write_end = os.pipe()
                ours.append(read_end)
                theirs.append(write_end)
            pid = self._request(theirs)
        except BaseException:
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        stdin_end = ours.pop(0) if stdin else None
        return pid, Pipes(stdin=stdin_end, stdout=ours[0], stderr=ours[1], status=ours[2])

    def _request(self, fds: list[int]) -> int:
        with self._lock:
            if self._owner_pid != os.getpid():
                # This process is a fork of the one that started the server: that server and its
                # socket belong to the parent; start our own.
                self._sock, self._proc = None, None
                self._start()
            reply = b""
            for attempt in range(2):
                if attempt:  # the server died (killed, or a bug): start a fresh one, once
                    self._stop()
                    self._start()
                assert self._sock is not None
                try:
                    socket.send_fds(self._sock, [b"run"], fds)
                    reply = self._sock.recv(256)
                except OSError:
                    reply = b""
                if reply:
                    break
        if not reply:
            raise SpawnError("the sandbox's fork server died and did not come back")
        if reply.startswith(b"error"):
            raise SpawnError(f"the sandbox's fork server could not start the run: {reply.decode()}")
        return int(reply)

    def _stop(self) -> None:
        if self._sock is not None:
            self._sock.close()  # end of file: the server exits
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._stop()


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(pgid, signal.SIGKILL)


def watch(
    pgid: int,
    pipes: Pipes,
    stdin: bytes | None,
    stdout: Capture,
    stderr: Capture,
    *,
    deadline: float,
    kill_output_bytes: int,
) -> tuple[bytes, str | None]:
    """Run the I/O of one run until it ends; returns its status lines and why it was killed, if it was."""
    selector = selectors.DefaultSelector()
    sinks: dict[int, Capture | None] = {pipes.stdout: stdout, pipes.stderr: stderr, pipes.status: None}
    for fd in sinks:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    pending = memoryview(stdin or b"")
    if pipes.stdin is not None:
        os.set_blocking(pipes.stdin, False)
        selector.register(pipes.stdin, selectors.EVENT_WRITE)
    status = bytearray()
    killed_by: str | None = None
    # Set once the status pipe closes (the run reported its end) or the run is killed. From then
    # on the run is not killed again: its process group may be gone and its id reused.
    grace_deadline: float | None = None
    try:
        while selector.get_map():
            now = time.monotonic()
            if grace_deadline is None and now >= deadline:
                kill_group(pgid)
                killed_by, grace_deadline = "timeout", now + KILL_GRACE_S
            if grace_deadline is not None and now >= grace_deadline:
                break
            wait = (grace_deadline if grace_deadline is not None else deadline) - now
            for key, _ in selector.select(timeout=max(wait, 0.0)):
                fd = int(key.fd)
                if fd == pipes.stdin:
                    try:
                        pending = pending[os.write(fd, pending[:65536]) :]
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending:
                        selector.unregister(fd)
                        os.close(fd)
                        pipes.stdin = None
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    selector.unregister(fd)
                    if fd == pipes.status and grace_deadline is None:
                        grace_deadline = time.monotonic() + KILL_GRACE_S
                    continue
                sink = sinks[fd]
                if sink is None:
                    status += chunk
                    continue
                sink.feed(chunk)
                if grace_deadline is None and stdout.num_bytes + stderr.num_bytes > kill_output_bytes:
                    kill_group(pgid)
                    killed_by, grace_deadline = "output", time.monotonic() + KILL_GRACE_S
    finally:
        selector.close()
        for end in (pipes.stdin, pipes.stdout, pipes.stderr, pipes.status):
            if end is not None:
                os.close(end)
    return bytes(status), killed_by

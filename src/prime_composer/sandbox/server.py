"""A sandboxed process that outlives one call: a server spoken to line by line (an MCP stdio server).

``Sandbox.start`` starts the command like any run (same fork server, namespaces, uid, rlimits,
seccomp and cgroup) but does not wait for it: it returns a ``ServerProcess`` whose stdin the
caller writes and whose stdout lines it reads (``send`` / ``receive``, each bounded by a deadline).
A thread per server drains its pipes: stdout into a queue of lines (a line longer than
``max_line_bytes`` ends the server), stderr into a bounded ``Capture`` (its last lines explain a
crash), and the status pipe, whose end means the server is gone.

The file tools (``sandbox/files.py``) work in the calling process and are safe only while no
sandboxed process of the workspace runs. So a server runs only while it serves a call:
``pause()`` SIGSTOPs every process of the workspace's uid (isolated mode: found in ``/proc``, so a
child that left the process group is stopped too) and waits until each one is stopped, and
``resume()`` sends them SIGCONT. A server that cannot be paused within ``PAUSE_TIMEOUT_S`` is
killed (the caller starts a new one when it needs it). Unisolated, the run's process group is
stopped (a process that left it is not; unisolated mode promises no isolation anyway).

``close()`` SIGKILLs the process group (isolated: the pid namespace's init dies with it, and the
kernel kills the rest of the namespace), waits for the status pipe to close and removes the
cgroup. Limits: the rlimits (``cpu_s`` is CPU seconds over the server's whole life), the cgroup's
memory, process and CPU limits, and no network, as for any run; the wall-clock limit is the
caller's deadline of each call, not the sandbox's ``timeout_s``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import select
import signal
import threading
import time
from pathlib import Path

from prime_composer.sandbox.cgroups import RunCgroup
from prime_composer.sandbox.output import Capture
from prime_composer.sandbox.spawn import Pipes, kill_group

PAUSE_TIMEOUT_S = 2.0
"""How long ``pause`` waits for the server's processes to stop before it kills the server."""


class ServerGone(Exception):
    """The server ended (crashed, was killed, closed its output, or wrote a line past the limit)."""


class ServerProcess:
    """One long-lived sandboxed process (see the module docstring); make one with ``Sandbox.start``."""

    def __init__(
        self,
        pgid: int,
        pipes: Pipes,
        *,
        uid: int | None,
        cgroup: RunCgroup | None,
        max_line_bytes: int,
        stderr_bytes: int,
    ) -> None:
        assert pipes.stdin is not None
        self.pgid, self.uid = pgid, uid
        self._stdin: int | None = pipes.stdin
        self._pipes = pipes
        self._cgroup = cgroup
        self._max_line_bytes = max_line_bytes
        self._lines: queue.Queue[bytes | None] = queue.Queue()
        self.stderr = Capture(stderr_bytes)
        self._status = bytearray()
        self._why_gone: str | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._drain, name=f"sandbox-server-{pgid}", daemon=True)
        self._reader.start()

    # -- talking to it --------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return not self._closed and self._reader.is_alive()

    def send(self, data: bytes, deadline: float) -> None:
        """Write ``data`` to the server's stdin by ``deadline``; raises ``ServerGone`` or ``TimeoutError``."""
        view = memoryview(data)
        while view:
            if self._stdin is None or not self.alive:
                raise ServerGone(self.describe())
            wait = deadline - time.monotonic()
            if wait <= 0:
                raise TimeoutError("the server did not read its input in time")
            _, writable, _ = select.select([], [self._stdin], [], min(wait, 0.5))
            if not writable:
                continue
            try:
                view = view[os.write(self._stdin, view[:65536]) :]
            except (BrokenPipeError, OSError):
                raise ServerGone(self.describe()) from None

    def receive(self, deadline: float) -> bytes:
        """The server's next stdout line (without its newline); ``ServerGone`` or ``TimeoutError``."""
        wait = deadline - time.monotonic()
        if wait <= 0:
            raise TimeoutError("the server did not answer in time")
        try:
            line = self._lines.get(timeout=wait)
        except queue.Empty:
            raise TimeoutError("the server did not answer in time") from None
        if line is None:
            self._lines.put(None)  # every later receive sees the end too
            raise ServerGone(self.describe())
        return line

    def describe(self) -> str:
        """How the server ended, for the model and the logs (its exit status and last stderr line)."""
        if self._why_gone is not None:
            why = self._why_gone
        else:
            facts = dict(
                line.partition(" ")[::2] for line in self._status.decode(errors="replace").splitlines()
            )
            if "signal" in facts:
                number = int(facts["signal"])
                why = (
                    f"killed by {signal.Signals(number).name if number in signal.valid_signals() else number}"
                )
            elif "exit" in facts:
                why = f"exit code {facts['exit']}"
            elif "exec_error" in facts:
                why = f"cannot execute {facts['exec_error']}"
            elif "setup_error" in facts:
                why = f"the sandbox could not set it up: {facts['setup_error']}"
            else:
                why = "it ended" if not self.alive else "still running"
        lines = self.stderr.text().strip().splitlines()
        return why + (f": {lines[-1]}" if lines else "")

    # -- pausing (the file tools' rule: nothing sandboxed runs while they work) -------------

    def pause(self) -> bool:
        """Stop every process of the server; False (and the server killed) if that did not work."""
        if not self.alive:
            return True
        if self.uid is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, signal.SIGSTOP)
            return True
        deadline = time.monotonic() + PAUSE_TIMEOUT_S
        while time.monotonic() < deadline:
            running = [pid for pid, state in self._processes() if state not in "TtZX"]
            if not running:
                return True
            for pid in running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            time.sleep(0.001)
        self._why_gone = f"killed: its processes did not stop within {PAUSE_TIMEOUT_S:g} s"
        self.close()
        return False

    def resume(self) -> None:
        if not self.alive:
            return
        if self.uid is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, signal.SIGCONT)
            return
        for pid, _ in self._processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def _processes(self) -> list[tuple[int, str]]:
        """(pid, state letter) of the server's processes: those of the workspace's uid, looked for
        in the run's cgroup when it has one (a few pids), else in all of ``/proc``."""
        assert self.uid is not None
        candidates: list[str] | None = None
        if self._cgroup is not None:
            with contextlib.suppress(OSError):
                candidates = Path(self._cgroup.procs_files[0]).read_text().split()
        if candidates is None:
            candidates = [entry.name for entry in os.scandir("/proc") if entry.name.isdigit()]
        return _processes_of(self.uid, candidates)

    # -- ending ---------------------------------------------------------------------------

    def close(self, why: str | None = None) -> None:
        """Kill the server and everything it started; wait (bounded) until it is gone."""
        with self._lock:
            if why is not None and self._why_gone is None:
                self._why_gone = why
            if self._closed:
                return
            self._closed = True
        kill_group(self.pgid)  # SIGKILL also ends stopped processes
        if self._stdin is not None:
            with contextlib.suppress(OSError):
                os.close(self._stdin)
            self._stdin = None
        self._reader.join(timeout=10)
        if self._cgroup is not None:
            self._cgroup.finish()

    def _drain(self) -> None:
        """The reader thread: stdout lines to the queue, stderr to its capture, until the status pipe closes."""
        fds = {self._pipes.stdout: "stdout", self._pipes.stderr: "stderr", self._pipes.status: "status"}
        partial = bytearray()
        grace: float | None = None
        try:
            while fds:
                if grace is not None and time.monotonic() >= grace:
                    break
                readable, _, _ = select.select(list(fds), [], [], 0.5)
                for fd in readable:
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        del fds[fd]
                        if fd == self._pipes.status:  # the run ended: read what is left, briefly
                            grace = time.monotonic() + 2.0
                        continue
                    if fds[fd] == "stderr":
                        self.stderr.feed(chunk)
                    elif fds[fd] == "status":
                        self._status += chunk
                    else:
                        partial += chunk
                        *lines, rest = bytes(partial).split(b"\n")
                        partial = bytearray(rest)
                        for line in lines:
                            self._lines.put(line)
                        if len(partial) > self._max_line_bytes:
                            self._why_gone = (
                                f"killed: it wrote a line longer than {self._max_line_bytes} bytes"
                            )
                            kill_group(self.pgid)
                            partial.clear()
        finally:
            for fd in (self._pipes.stdout, self._pipes.stderr, self._pipes.status):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._lines.put(None)


def _processes_of(uid: int, pids: list[str]) -> list[tuple[int, str]]:
    """(pid, state letter) of those of ``pids`` whose real uid is ``uid``."""
    found: list[tuple[int, str]] = []
    for pid in pids:
        try:
            status = Path("/proc", pid, "status").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("Uid", "").split()[:1] == [str(uid)]:
            found.append((int(pid), fields.get("State", "?").strip()[:1]))
    return found

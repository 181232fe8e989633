"""Child processes that live and die as one group with their parent (stdlib only).

Each child the launcher, ``eval`` or the vLLM backend starts runs in a new session (its own
process group), so the whole tree under it (torchrun and its ranks, vLLM's engine core and
workers) is signalled at once, and a Ctrl-C in the terminal reaches only the parent, which then
stops its children in order. On Linux each child also asks the kernel to SIGTERM it when the
parent dies, so even a SIGKILLed parent leaves no orphans.

Usage::

    child = subprocess.Popen(argv, start_new_session=True, preexec_fn=die_with_parent)
    stop_group(child, grace_s=30)      # SIGTERM the group, SIGKILL what is left after 30 s
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for children: runs between fork and exec and asks the kernel to SIGTERM the
    child when this process dies, even by SIGKILL (Linux only; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def signal_group(pgid: int, signum: int) -> None:
    """Send ``signum`` to process group ``pgid``; a group that is already gone is not an error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def stop_group(child: subprocess.Popen[bytes], grace_s: float) -> int | None:
    """SIGTERM the group led by ``child``, wait up to ``grace_s`` for it, then SIGKILL whatever is
    left of the group (the leader may be gone while its children linger); returns its exit code."""
    if child.poll() is None:
        signal_group(child.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=grace_s)
    signal_group(child.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=grace_s)
    return child.returncode

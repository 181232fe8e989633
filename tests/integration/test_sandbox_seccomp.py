"""No new namespaces inside the sandbox: the seccomp filter refuses ``unshare``/``clone`` with
namespace flags, ``setns``, ``mount``, ``ptrace``, ``bpf``, ``keyctl``, ... while ordinary
processes and threads work; a missing libseccomp refuses to start."""

from __future__ import annotations

import ctypes
import json
import logging
import os
from collections.abc import Iterator

import pytest

from prime_composer.config.sandbox import SandboxConfig
from prime_composer.sandbox import IsolationUnavailable, Sandbox, Workspace

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="isolated runs need root")


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    with Sandbox(SandboxConfig()) as sandbox:
        assert sandbox.isolated
        yield sandbox


@pytest.fixture
def workspace(sandbox: Sandbox) -> Iterator[Workspace]:
    with sandbox.workspace() as workspace:
        yield workspace


def syscall_numbers(*names: str) -> dict[str, int]:
    """This machine's numbers of ``names``, read from libseccomp's own tables."""
    lib = ctypes.CDLL("libseccomp.so.2")
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    return {name: lib.seccomp_syscall_resolve_name(name.encode()) for name in names}


def test_unshare_fails_inside(sandbox: Sandbox, workspace: Workspace) -> None:
    for command in ("unshare -U true", "unshare -Urm true", "unshare -n true"):
        result = sandbox.run(workspace, command)
        assert result.exit_code == 1, command
        assert "unshare failed: Operation not permitted" in result.stderr, command


def test_refused_system_calls_fail_with_eperm_and_ordinary_ones_work(
    sandbox: Sandbox, workspace: Workspace
) -> None:
    numbers = syscall_numbers("setns", "mount", "ptrace", "bpf", "keyctl", "io_uring_setup", "clone3")
    code = (
        "import ctypes, json, os, subprocess, sys, threading\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "out = {}\n"
        "for name, number in json.loads(sys.argv[1]).items():\n"
        "    result = libc.syscall(number, 0, 0, 0, 0, 0)\n"
        "    out[name] = os.strerror(ctypes.get_errno()) if result == -1 else 'ok'\n"
        "out['unshare(CLONE_NEWUSER)'] = libc.unshare(0x10000000) == -1 and os.strerror(ctypes.get_errno())\n"
        "out['unshare(CLONE_FILES)'] = libc.unshare(0x400)\n"
        "t = threading.Thread(target=lambda: None); t.start(); t.join()\n"
        "out['subprocess'] = subprocess.run(['true']).returncode\n"
        "status = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines())\n"
        "out['seccomp'] = status['Seccomp'].strip(); out['nnp'] = status['NoNewPrivs'].strip()\n"
        "print(json.dumps(out))\n"
    )
    result = sandbox.run(workspace, ["python", "-c", code, json.dumps(numbers)])
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    for name in ("setns", "mount", "ptrace", "bpf", "keyctl", "io_uring_setup"):
        assert out[name] == "Operation not permitted", name
    assert out["clone3"] == "Function not implemented"  # so the C library falls back to clone
    assert out["unshare(CLONE_NEWUSER)"] == "Operation not permitted"
    assert out["unshare(CLONE_FILES)"] == 0  # no namespace flag: allowed
    assert out["subprocess"] == 0
    assert out["seccomp"] == "2" and out["nnp"] == "1"  # 2: filter mode


def test_without_the_filter_user_namespaces_are_possible_and_a_warning_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The control: this machine allows unprivileged user namespaces, so the refusal above is the
    # filter's doing.
    script = "unshare -Urm sh -c 'id -u; mount -t tmpfs none /tmp && echo mounted'"
    with (
        caplog.at_level(logging.WARNING),
        Sandbox(SandboxConfig(seccomp=False)) as sandbox,
        sandbox.workspace() as workspace,
    ):
        result = sandbox.run(workspace, script)
    assert "SANDBOX WITHOUT SECCOMP" in caplog.text
    assert result.exit_code == 0 and result.stdout == "0\nmounted\n", result.stderr


def test_a_missing_libseccomp_refuses_to_start() -> None:
    missing = "/nonexistent/libseccomp.so.2"
    with pytest.raises(IsolationUnavailable, match=f"seccomp: cannot use {missing}.*sandbox.seccomp = false"):
        Sandbox(SandboxConfig(seccomp_library=missing))

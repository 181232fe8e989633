"""What a sandboxed command can reach: no network, its own user, only its workspace writable,
nothing of the host but the allowlist (no checkout, no answer key), hidden folders hidden, no
secrets in its environment, no view of other processes."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from prime_composer.config.sandbox import SandboxConfig
from prime_composer.sandbox import Sandbox, Workspace

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


def python(sandbox: Sandbox, workspace: Workspace, code: str, *args: str) -> str:
    result = sandbox.run(workspace, ["python", "-c", code, *args])
    assert result.exit_code == 0, result.stderr
    return result.stdout


def test_no_network_but_loopback_works(sandbox: Sandbox, workspace: Workspace) -> None:
    # A server listening on this machine's loopback is not reachable from the sandbox.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = (
            "import socket\n"
            "for host in ('127.0.0.1', '1.1.1.1'):\n"
            "    try:\n"
            f"        socket.create_connection((host, {port}), timeout=2)\n"
            "        print(host, 'connected')\n"
            "    except OSError as e:\n"
            "        print(host, e.errno)\n"
            "print(open('/proc/net/dev').read().count(':'))\n"
        )
        lines = python(sandbox, workspace, code).splitlines()
    assert lines[0] == "127.0.0.1 111"  # ECONNREFUSED: its own loopback has no such server
    assert lines[1] == "1.1.1.1 101"  # ENETUNREACH: no route out
    assert lines[2] == "1"  # one interface: lo
    # Inside, processes of one run talk to each other over 127.0.0.1.
    echo = (
        "import socket, threading\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
        "threading.Thread(target=lambda: s.accept()[0].sendall(b'pong'), daemon=True).start()\n"
        "c = socket.create_connection(s.getsockname()); print(c.recv(4).decode())\n"
    )
    assert python(sandbox, workspace, echo) == "pong\n"


def test_runs_as_the_workspace_user_without_privileges(sandbox: Sandbox, workspace: Workspace) -> None:
    code = (
        "import os, json\n"
        "status = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines())\n"
        "print(json.dumps({'ids': [os.getuid(), os.geteuid(), os.getgid()], 'groups': os.getgroups(),\n"
        "    'caps': status['CapEff'].strip(), 'nnp': status['NoNewPrivs'].strip(), 'pid': os.getpid(),\n"
        "    'host': os.uname().nodename, 'pids': sorted(int(p) for p in os.listdir('/proc') if p.isdigit())}))\n"
    )
    info = json.loads(python(sandbox, workspace, code))
    assert info["ids"] == [workspace.uid] * 3 and info["groups"] == []
    assert int(info["caps"], 16) == 0 and info["nnp"] == "1"
    assert info["host"] == "sandbox"
    # Its own pid namespace: the set-up process is pid 1, the command pid 2; nothing else is visible.
    assert info["pid"] == 2 and info["pids"] == [1, 2]


def test_only_the_workspace_and_its_tmp_are_writable(sandbox: Sandbox, workspace: Workspace) -> None:
    tag = secrets.token_hex(4)
    with sandbox.workspace() as other:
        (other.path / "theirs.txt").write_text("other episode")
        targets = [
            "/etc/sandbox-probe",
            "/usr/sandbox-probe",
            "/var/lib/sandbox-probe",
            str(sandbox.root_dir / "sandbox-probe"),
            str(workspace.root / "sandbox-probe"),
            str(Path(shutil.which("python") or "/usr/bin/python3").parent / "sandbox-probe"),
            f"{sandbox.config.python_env or sys.prefix}/sandbox-probe",
            str(other.path / "sandbox-probe"),
            str(other.root / "sandbox-probe"),
        ]
        code = (
            "import json, sys\n"
            "out = {}\n"
            "for path in json.loads(sys.argv[1]):\n"
            "    try:\n"
            "        open(path, 'w').write('x'); out[path] = 'written'\n"
            "    except OSError as e:\n"
            "        out[path] = e.strerror\n"
            f"for path in ['work.txt', '/tmp/t{tag}', '/var/tmp/v{tag}', '/dev/shm/s{tag}']:\n"
            "    open(path, 'w').write(path); out[path] = 'written'\n"
            "try:\n"
            f"    open({str(other.path / 'theirs.txt')!r}).read(); out['read other'] = 'read'\n"
            "except OSError as e:\n"
            "    out['read other'] = e.strerror\n"
            "print(json.dumps(out))\n"
        )
        result = sandbox.run(workspace, ["python", "-c", code, json.dumps(targets)])
        assert result.exit_code == 0, result.stderr
        out = json.loads(result.stdout)
        for target in targets[:-2]:
            assert out[target] in ("Permission denied", "Read-only file system"), target
        for target in targets[-2:]:  # another workspace is not there at all
            assert out[target] == "No such file or directory", target
        for target in targets:
            assert not Path(target).exists()
        assert out["read other"] == "No such file or directory"
    # The private tmp folders are the workspace's own tmp/, not the machine's.
    # (Folders there are mount points of a Python environment under /tmp, e.g. a clone's venv.)
    written = sorted(p.name for p in workspace.tmp.iterdir() if not p.is_dir())
    assert written == [f"s{tag}", f"t{tag}", f"v{tag}"]
    assert (workspace.path / "work.txt").read_text() == "work.txt"
    for host_path in (f"/tmp/t{tag}", f"/var/tmp/v{tag}", f"/dev/shm/s{tag}"):
        assert not Path(host_path).exists()


def test_hidden_folders_are_empty_and_exposed_ones_read_only(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    base = Path("/var/lib/prime-composer") / f"test-hidden-{secrets.token_hex(4)}"
    (base / "pub").mkdir(parents=True)
    try:
        (base / "secret.txt").write_text("root only")
        (base / "pub" / "tool.txt").write_text("public")
        os.chmod(base / "pub", 0o777)  # writable by anyone on the host; read-only inside
        config = SandboxConfig(hidden_paths=[base], exposed_paths=[base / "pub"])
        with Sandbox(config) as sandbox, sandbox.workspace() as workspace:
            listing = sandbox.run(workspace, f"ls -A {base}; cat {base}/pub/tool.txt; touch {base}/pub/new")
            assert listing.stdout == "pub\npublic"
            assert "Read-only file system" in listing.stderr
            assert not (base / "pub" / "new").exists()
    finally:
        shutil.rmtree(base)


def test_environment_is_scrubbed(
    sandbox: Sandbox, workspace: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = secrets.token_hex(16)
    monkeypatch.setenv("OPENAI_API_KEY", token)
    monkeypatch.setenv("PRIME_COMPOSER_TEST_SECRET", token)
    result = sandbox.run(
        workspace,
        f"env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'; grep -rs {token} /proc/[0-9]*/environ",
    )
    assert token not in result.stdout + result.stderr
    env = dict(line.split("=", 1) for line in sandbox.run(workspace, ["env"]).stdout.splitlines())
    assert set(env) - {"PWD", "SHLVL", "_"} == set(sandbox.environment(workspace))
    assert env["HOME"] == str(workspace.path) and env["PYTHONDONTWRITEBYTECODE"] == "1"


def test_python_and_pytest_work_inside(sandbox: Sandbox, workspace: Workspace) -> None:
    (workspace.path / "test_ok.py").write_text("def test_ok():\n    assert 1 + 1 == 2\n")
    workspace.give(workspace.path / "test_ok.py")
    result = sandbox.run(
        workspace,
        ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        limits=sandbox.config.test_limits,
    )
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout


def test_concurrent_workspaces_get_distinct_users(sandbox: Sandbox) -> None:
    workspaces = [sandbox.workspace() for _ in range(4)]
    try:
        uids = {ws.uid for ws in workspaces}
        assert len(uids) == 4
        for ws in workspaces:
            assert ws.path.stat().st_uid == ws.uid and (ws.path.stat().st_mode & 0o777) == 0o700
    finally:
        for ws in workspaces:
            ws.close()
    assert all(not ws.root.exists() for ws in workspaces)


CHECKOUT = Path(__file__).resolve().parents[2]


def test_nothing_of_the_host_but_the_allowlist_is_visible(sandbox: Sandbox, workspace: Workspace) -> None:
    # Every file the command can find outside the system runtime (/usr and what links into it,
    # a few files of /etc, device nodes, /proc) belongs to the Python environment or the workspace.
    code = (
        "import json, os\n"
        "found = []\n"
        "for top in sorted(os.listdir('/')):\n"
        "    if top in ('proc', 'usr', 'dev') or os.path.islink('/' + top):\n"
        "        continue\n"
        "    for folder, dirs, files in os.walk('/' + top):\n"
        "        found += [os.path.join(folder, f) for f in files]\n"
        "json.dump({'top': sorted(os.listdir('/')), 'files': found}, open('found.json', 'w'))\n"
    )
    python(sandbox, workspace, code)
    seen = json.loads((workspace.path / "found.json").read_text())
    allowed = [
        str(sandbox.config.python_env or sys.prefix),
        os.path.realpath(sys.prefix),
        os.path.realpath(sys.base_prefix),
        str(workspace.root),
        "/etc/",
    ]
    outside = [f for f in seen["files"] if not any(f.startswith(a) for a in allowed)]
    assert outside == []
    # Top-level folders of the host that hold no allowed path are not there at all.
    for top in ("opt", "srv", "mnt", "media", "home", "boot", "run", "sys", "old_root", "farm"):
        assert top not in seen["top"] or any(a.startswith(f"/{top}/") for a in allowed), top
    # /var holds only the way to the workspace and the private /var/tmp.
    var = sandbox.run(workspace, "ls -A /var /var/lib").stdout.split()
    assert set(var) <= {"/var:", "/var/lib:", "lib", "tmp", *Path(str(sandbox.root_dir)).parts}


def test_no_environment_source_or_answer_key_is_readable(sandbox: Sandbox, workspace: Workspace) -> None:
    answer_key = CHECKOUT / "environments/pyfix/pyfix/taskset.py"
    assert "buggy" in answer_key.read_text()  # the table of original and buggy expressions
    secrets_on_host = [
        answer_key,
        CHECKOUT / "environments/feature_deletion/feature_deletion/tasks.py",
        CHECKOUT / "src/prime_composer/sandbox/sandbox.py",  # the test's own checkout
        CHECKOUT / "pyproject.toml",
        Path("/work/main/pyproject.toml"),
    ]
    code = (
        "import json, sys\n"
        "out = {}\n"
        "for path in sys.argv[1:]:\n"
        "    try:\n"
        "        out[path] = open(path).read()[:20]\n"
        "    except OSError as e:\n"
        "        out[path] = e.strerror\n"
        "print(json.dumps(out))\n"
    )
    out = json.loads(python(sandbox, workspace, code + "#", *map(str, secrets_on_host)))
    assert out == {str(p): "No such file or directory" for p in secrets_on_host}
    # Not through the Python environment's editable install either.
    result = sandbox.run(workspace, ["python", "-c", "import prime_composer"])
    assert result.exit_code == 1 and "ModuleNotFoundError" in result.stderr


def test_a_python_environment_under_tmp_is_bound_in(tmp_path: Path) -> None:
    # A fresh clone under /tmp has its venv there; the private /tmp must not cover it.
    venv = Path("/tmp") / f"sandbox-venv-{secrets.token_hex(4)}" / ".venv"
    try:
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True
        )
        site = next(venv.glob("lib/python3*/site-packages"))
        (site / "marker_pkg.py").write_text("VALUE = 'from the venv under /tmp'\n")
        with Sandbox(SandboxConfig(python_env=venv)) as sandbox, sandbox.workspace() as workspace:
            result = sandbox.run(
                workspace,
                "python -c 'import sys, marker_pkg; print(sys.prefix, marker_pkg.VALUE)'; ls -A /tmp",
            )
            assert result.exit_code == 0, result.stderr
            assert result.stdout.splitlines()[0] == f"{venv} from the venv under /tmp"
            # /tmp is still the workspace's own: writable, nothing of the machine's /tmp in it.
            assert result.stdout.splitlines()[1:] == [venv.parent.name]
            write = sandbox.run(workspace, f"touch /tmp/mine && touch {venv}/x")
            assert "Read-only file system" in write.stderr and (workspace.tmp / "mine").exists()
    finally:
        shutil.rmtree(venv.parent, ignore_errors=True)


def test_a_python_environment_inside_a_hidden_folder_is_bound_in() -> None:
    # A checkout whose folder is hidden (its sources must not be readable) still runs its own venv.
    top = Path("/var/lib") / f"sandbox-hidden-venv-{secrets.token_hex(4)}"
    hidden = top / "exposed" / "checkout"
    venv = hidden / ".venv"
    try:
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True
        )
        (hidden / "answer_key.py").write_text("ANSWER = 42\n")
        site = next(venv.glob("lib/python3*/site-packages"))
        (site / "marker_pkg.py").write_text("VALUE = 'from the hidden checkout'\n")
        config = SandboxConfig(python_env=venv, exposed_paths=[top / "exposed"], hidden_paths=[hidden])
        with Sandbox(config) as sandbox, sandbox.workspace() as workspace:
            result = sandbox.run(
                workspace, f"python -c 'import marker_pkg; print(marker_pkg.VALUE)'; ls -A {hidden}"
            )
            assert result.exit_code == 0, result.stderr
            # Only the venv shows through the hidden folder, not the file beside it.
            assert result.stdout.splitlines() == ["from the hidden checkout", ".venv"]
            read = sandbox.run(workspace, f"cat {hidden / 'answer_key.py'}")
            assert read.exit_code == 1 and "No such file or directory" in read.stderr
    finally:
        shutil.rmtree(top, ignore_errors=True)

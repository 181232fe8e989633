"""The launcher with real child processes: a crash, Ctrl-C / SIGTERM, and a clean finish.

Each fake child writes its pid (and the pid of a grandchild it spawns) to a file, so the tests
can check that whole process trees are gone afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from prime_composer.launch.launcher import Launcher
from prime_composer.launch.process import ProcessSpec

CHILD = textwrap.dedent(
    """
    import os, subprocess, sys, time
    name, pid_dir, lifetime, code = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.path.join(pid_dir, name), "w") as f:
        f.write(f"{os.getpid()} {grandchild.pid}")
    print(f"{name} started", flush=True)
    if lifetime >= 0:
        time.sleep(lifetime)
        print(f"{name} exiting with {code}", flush=True)
        grandchild.kill()
        sys.exit(code)
    time.sleep(600)
    """
)


def spec(tmp_path: Path, name: str, kind: str, lifetime: float, code: int = 0) -> ProcessSpec:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir(exist_ok=True)
    return ProcessSpec(
        name=name,
        argv=[sys.executable, str(script), name, str(pid_dir), str(lifetime), str(code)],
        kind=kind,  # type: ignore[arg-type]
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose; /proc tells.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def survivors(tmp_path: Path, grace_s: float = 3.0) -> list[int]:
    """The recorded processes still alive ``grace_s`` after the run returned (a SIGKILLed process
    of another parent can take a moment to go on a loaded machine; an orphan never goes)."""
    deadline = time.monotonic() + grace_s
    while (left := [p for p in all_pids(tmp_path) if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def all_pids(tmp_path: Path) -> list[int]:
    pids = []
    for f in (tmp_path / "pids").iterdir():
        pids += [int(p) for p in f.read_text().split()]
    return pids


def wait_for_pids(tmp_path: Path, count: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (tmp_path / "pids").exists() and len(list((tmp_path / "pids").iterdir())) >= count:
            return
        time.sleep(0.05)
    raise AssertionError("children did not start")


def test_crash_stops_the_others_and_leaves_nothing_running(tmp_path: Path) -> None:
    messages: list[str] = []
    launcher = Launcher(
        [
            spec(tmp_path, "server", "service", -1),
            spec(tmp_path, "worker", "job", -1),
            spec(tmp_path, "crasher", "job", 1.0, code=3),
        ],
        tmp_path / "logs",
        stop_timeout_s=5,
        echo=messages.append,
    )
    result = launcher.run()
    assert result.exit_code == 1
    assert result.failed == "crasher"
    assert "crasher exited with code 3" in messages[0]
    assert "crasher exiting with 3" in messages[0]  # the tail of its log is shown
    pids = all_pids(tmp_path)
    assert len(pids) == 6
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)]
    assert (tmp_path / "logs" / "server.log").read_text().startswith("server started")


def test_clean_finish_stops_services(tmp_path: Path) -> None:
    launcher = Launcher(
        [
            spec(tmp_path, "server", "service", -1),
            spec(tmp_path, "a", "job", 0.5),
            spec(tmp_path, "b", "job", 1.0),
        ],
        tmp_path / "logs",
        stop_timeout_s=5,
        echo=lambda _: None,
    )
    result = launcher.run()
    assert result.exit_code == 0 and result.failed is None
    assert not survivors(tmp_path)


def test_service_that_dies_fails_the_run(tmp_path: Path) -> None:
    launcher = Launcher(
        [spec(tmp_path, "server", "service", 0.5, code=0), spec(tmp_path, "job", "job", -1)],
        tmp_path / "logs",
        stop_timeout_s=5,
        echo=lambda _: None,
    )
    result = launcher.run()
    assert result.exit_code == 1 and result.failed == "server"
    assert not survivors(tmp_path)


def test_health_wait_fails_when_server_dies_before_healthy(tmp_path: Path) -> None:
    server = spec(tmp_path, "server", "service", 0.3, code=7)
    server.health_url = "http://127.0.0.1:9/health"  # nothing listens on the discard port
    later = spec(tmp_path, "job", "job", -1)
    messages: list[str] = []
    result = Launcher([server, later], tmp_path / "logs", echo=messages.append).run()
    assert result.failed == "server"
    assert "before it was healthy" in result.reason
    assert not (tmp_path / "pids" / "job").exists()  # the dependent never started


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_stops_everything(tmp_path: Path, sig: signal.Signals, code: int) -> None:
    specs = [spec(tmp_path, "server", "service", -1), spec(tmp_path, "job", "job", -1)]
    driver = tmp_path / "driver.py"
    driver.write_text(
        textwrap.dedent(
            f"""
            import sys
            from pathlib import Path
            from prime_composer.launch.launcher import Launcher
            from prime_composer.launch.process import ProcessSpec
            specs = [ProcessSpec(name=n, argv=a, kind=k) for n, a, k in {[(s.name, s.argv, s.kind) for s in specs]!r}]
            sys.exit(Launcher(specs, Path({str(tmp_path / "logs")!r}), stop_timeout_s=5).run().exit_code)
            """
        )
    )
    proc = subprocess.Popen([sys.executable, str(driver)])
    wait_for_pids(tmp_path, 2)
    time.sleep(0.3)
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == code
    assert not survivors(tmp_path)


def test_launcher_killed_with_sigkill_leaves_no_orphans(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG: children get SIGTERM when the launcher dies without cleaning up."""
    specs = [spec(tmp_path, "server", "service", -1)]
    driver = tmp_path / "driver.py"
    driver.write_text(
        textwrap.dedent(
            f"""
            from pathlib import Path
            from prime_composer.launch.launcher import Launcher
            from prime_composer.launch.process import ProcessSpec
            s = {[(s.name, s.argv, s.kind) for s in specs]!r}[0]
            Launcher([ProcessSpec(name=s[0], argv=s[1], kind=s[2])], Path({str(tmp_path / "logs")!r})).run()
            """
        )
    )
    proc = subprocess.Popen([sys.executable, str(driver)])
    wait_for_pids(tmp_path, 1)
    proc.kill()
    proc.wait()
    child_pid = all_pids(tmp_path)[0]
    deadline = time.monotonic() + 10
    while alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child_pid)


# --------------------------------------------------------------------- overlapped starts (gates)

SERVER = textwrap.dedent(
    """
    import http.server, os, sys, time
    port, delay, out, code = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    time.sleep(delay)  # loading its model
    if code:
        sys.exit(code)  # it dies before it ever answers
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *args):
            pass
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
    with open(out, "w") as f:
        f.write(str(time.time()))
    server.serve_forever()
    """
)

CLIENT = textwrap.dedent(
    """
    import json, os, sys, time, urllib.request
    from prime_composer.start_gate import GATE_ENV, wait_start_gate
    url, out = sys.argv[1], sys.argv[2]
    record = {"started": time.time(), "gated": GATE_ENV in os.environ}
    with open(out + ".started", "w") as f:
        f.write(json.dumps(record))
    record["waited"] = wait_start_gate()
    record["opened"] = time.time()
    record["env_left"] = GATE_ENV in os.environ  # not passed on to its children
    with urllib.request.urlopen(url, timeout=5) as r:  # the first request: the server must be up
        record["status"] = r.status
    with open(out, "w") as f:
        f.write(json.dumps(record))
    """
)


def _server(tmp_path: Path, port: int, delay: float, code: int = 0) -> ProcessSpec:
    (tmp_path / "server.py").write_text(SERVER)
    return ProcessSpec(
        name="server",
        argv=[
            sys.executable,
            str(tmp_path / "server.py"),
            str(port),
            str(delay),
            str(tmp_path / "healthy"),
            str(code),
        ],
        kind="service",
        health_url=f"http://127.0.0.1:{port}/health",
    )


def _client(tmp_path: Path, name: str, port: int, **how: object) -> ProcessSpec:
    (tmp_path / "client.py").write_text(CLIENT)
    return ProcessSpec(
        name=name,
        argv=[
            sys.executable,
            str(tmp_path / "client.py"),
            f"http://127.0.0.1:{port}/health",
            str(tmp_path / name),
        ],
        kind="job",
        **how,  # type: ignore[arg-type]
    )


@pytest.mark.slow
def test_early_processes_start_with_the_server_and_call_it_only_once_healthy(tmp_path: Path) -> None:
    from prime_composer.config.ports import free_port

    port = free_port()
    specs = [
        _server(tmp_path, port, delay=3.0),
        _client(tmp_path, "early", port, starts_early=True),  # the orchestrator's way
        _client(tmp_path, "ordered", port),  # the default: after the server is healthy
    ]
    result = Launcher(specs, tmp_path / "logs", stop_timeout_s=5, echo=lambda _: None).run()
    assert result.exit_code == 0, result.reason
    healthy = float((tmp_path / "healthy").read_text())
    early = json.loads((tmp_path / "early").read_text())
    ordered = json.loads((tmp_path / "ordered").read_text())
    # The early one ran its setup while the server loaded, and its first request came after.
    assert early["gated"] and early["started"] < healthy <= early["opened"]
    assert early["waited"] > 0 and early["status"] == 200 and not early["env_left"]
    # The one in the default order started only after the server answered, with no gate.
    assert ordered["started"] >= healthy and not ordered["gated"] and ordered["waited"] == 0
    assert not survivors_of(specs)


def test_a_server_that_dies_while_an_early_process_waits_fails_the_run_naming_it(tmp_path: Path) -> None:
    from prime_composer.config.ports import free_port

    port = free_port()
    specs = [
        _server(tmp_path, port, delay=1.0, code=7),
        _client(tmp_path, "early", port, starts_early=True),
    ]
    at_once = spec(tmp_path, "at-once", "job", -1)  # the trainer's way: it calls no server
    at_once.waits_for = ()
    specs.append(at_once)
    messages: list[str] = []
    result = Launcher(specs, tmp_path / "logs", stop_timeout_s=5, echo=messages.append).run()
    assert result.exit_code == 1 and result.failed == "server"
    assert result.reason == "server exited with code 7 before it was healthy"
    assert messages and messages[0].startswith("error: server exited with code 7 before it was healthy")
    assert (tmp_path / "early.started").exists()  # it had started ...
    assert not (tmp_path / "early").exists()  # ... and never got past its gate
    assert (tmp_path / "pids" / "at-once").exists()  # started without waiting, then stopped
    assert not survivors_of(specs) and not survivors(tmp_path)


def test_a_server_that_never_answers_times_out_and_stops_the_waiting_processes(tmp_path: Path) -> None:
    from prime_composer.config.ports import free_port

    port = free_port()
    specs = [_server(tmp_path, port, delay=600.0), _client(tmp_path, "early", port, starts_early=True)]
    result = Launcher(
        specs, tmp_path / "logs", health_timeout_s=2.0, stop_timeout_s=5, echo=lambda _: None
    ).run()
    assert (
        result.failed == "server"
        and "did not answer" in result.reason
        and "health_timeout_s" in result.reason
    )
    assert (tmp_path / "early.started").exists() and not (tmp_path / "early").exists()
    assert not survivors_of(specs)


def test_waiting_for_a_service_that_is_not_there_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"job waits for inferense: .* the services are: server"):
        Launcher(
            [
                ProcessSpec("server", ["true"], "service", health_url="http://127.0.0.1:9/health"),
                ProcessSpec("job", ["true"], "job", waits_for=("inferense",)),
            ],
            tmp_path / "logs",
        )


def survivors_of(specs: list[ProcessSpec], grace_s: float = 5.0) -> list[str]:
    """The names of ``specs`` whose script still runs ``grace_s`` after the run returned."""
    scripts = {s.argv[1] for s in specs}
    deadline = time.monotonic() + grace_s
    while True:
        left = []
        for proc in Path("/proc").iterdir():
            try:
                cmd = (proc / "cmdline").read_bytes().split(b"\0")
            except (OSError, ValueError):
                continue
            if len(cmd) > 1 and cmd[1].decode(errors="replace") in scripts and alive(int(proc.name)):
                left.append(cmd[1].decode())
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)

"""The launcher's stop at the end of a run: the services are signalled together, not one after
the other (a run with an inference server, a teacher service and its servers used to wait for
each in turn), and none is left running."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from prime_composer.launch.launcher import Launcher
from prime_composer.launch.process import ProcessSpec

# A service that, once told to stop, waits for the other service to be told too (30 s at most),
# and says whether it saw that. Stopped one after the other, the first would never see it.
SERVICE = textwrap.dedent(
    """
    import signal, sys, time
    from pathlib import Path
    name, other, root = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    def on_term(*_):
        (root / f"termed-{name}").touch()
        deadline = time.monotonic() + 30
        while not (root / f"termed-{other}").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        if (root / f"termed-{other}").exists():
            (root / f"saw-{name}").touch()
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    (root / f"ready-{name}").touch()
    while True:
        time.sleep(0.05)
    """
)
JOB = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    root = Path(sys.argv[1])
    while not all((root / f"ready-{n}").exists() for n in ("a", "b")):
        time.sleep(0.02)
    """
)


def test_services_are_stopped_together_and_none_is_left(tmp_path: Path) -> None:
    def service(name: str, other: str) -> ProcessSpec:
        argv = [sys.executable, "-c", SERVICE, name, other, str(tmp_path)]
        return ProcessSpec(name=name, argv=argv, kind="service")

    job = ProcessSpec(name="job", argv=[sys.executable, "-c", JOB, str(tmp_path)], kind="job")
    launcher = Launcher([service("a", "b"), service("b", "a"), job], tmp_path / "logs", stop_timeout_s=60)
    result = launcher.run()
    assert result.exit_code == 0, result.reason
    # Each service was still running when the other got its SIGTERM: both were signalled first.
    assert (tmp_path / "saw-a").exists() and (tmp_path / "saw-b").exists()
    assert all(proc.poll() == 0 for proc in launcher.processes)  # every one exited, cleanly

"""Start a list of processes in order, watch them, and stop all of them together.

The launcher knows nothing about RL: it gets ``ProcessSpec``s (inference, orchestrator, trainer,
later the teacher service) and a progress callback. Rules:

- processes start in the given order; one with a ``health_url`` must answer 200 before the
  processes that wait for it start: by default every later one (``ProcessSpec.waits_for``), or
  only those that name it. A process that ``starts_early`` starts at once and blocks at its start
  gate (``start_gate.py``) until what it waits for is healthy, so its setup overlaps the
  services' start, and it never talks to a server that is not up;
- while processes start, the launcher watches every one already started: one that dies before it
  was healthy, a job that fails, or a service that exits fails the run as it would later;
- the run succeeds when every ``job`` has exited 0; ``service``s are then stopped;
- the first process to fail (a job exiting non-zero, or a service exiting at all) fails the run:
  the launcher names it, prints the tail of its log and the resume hint, and stops the others;
  a service of a ``group`` (inference replicas) that exits is reported once, and fails the run
  only when it was the last of its group running;
- SIGINT / SIGTERM stop everything cleanly (exit 130 / 143);
- stopping signals the jobs still running together, waits for them, then the services together
  (``stop_all``): nothing is left running, and a run with several servers stops in the time of
  its slowest one.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prime_composer.health import poll_health
from prime_composer.launch.process import ManagedProcess, ProcessSpec
from prime_composer.start_gate import GATE_ENV


@dataclass
class LaunchResult:
    exit_code: int
    failed: str | None = None
    """Name of the process that failed the run, if any."""
    reason: str = ""
    failed_exit_code: int | None = None
    """Exit code of the process that failed the run (None when it was stopped or never exited)."""


class Launcher:
    def __init__(
        self,
        specs: list[ProcessSpec],
        log_dir: Path,
        *,
        health_timeout_s: float = 300.0,
        stop_timeout_s: float = 10.0,
        poll_s: float = 0.2,
        on_tick: Callable[[dict[str, str]], None] | None = None,
        echo: Callable[[str], None] = print,
    ) -> None:
        _check_waits(specs)
        self.processes = [ManagedProcess(s, log_dir / f"{s.name}.log") for s in specs]
        self.health_timeout_s = health_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.poll_s = poll_s
        self.on_tick = on_tick
        self.echo = echo
        self._signal: int | None = None
        self._lost: set[str] = set()
        """Services of a group that exited while others of the group ran on."""

    # ------------------------------------------------------------------------------------ public

    def run(self) -> LaunchResult:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        gates = Path(tempfile.mkdtemp(prefix="prime-composer-gates-"))
        try:
            result = self._start_all(gates) or self._watch()
        finally:
            self.stop_all()
            shutil.rmtree(gates, ignore_errors=True)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return result

    def stop_all(self) -> None:
        """Stop every process: the jobs (trainer, orchestrator: the consumers) before the services
        they use, each of the two at once: SIGTERM to every process group of it, then the wait
        (SIGKILL after ``stop_timeout_s``) of each, so the services (inference, its replicas, the
        teacher and its servers) stop in about the time of the slowest, not in the sum of all."""
        started = [p for p in reversed(self.processes) if p.popen is not None]
        for kind in ("job", "service"):
            batch = [p for p in started if p.spec.kind == kind]
            for proc in batch:
                proc.terminate()
            for proc in batch:
                proc.stop(self.stop_timeout_s)

    def statuses(self) -> dict[str, str]:
        out = {}
        for proc in self.processes:
            code = proc.poll()
            out[proc.name] = (
                "not started" if proc.popen is None else "running" if code is None else f"exited {code}"
            )
        return out

    # ----------------------------------------------------------------------------------- internals

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signal = signum

    def _interrupted(self) -> LaunchResult | None:
        if self._signal is None:
            return None
        name = signal.Signals(self._signal).name
        self.echo(f"{name} received: stopping all processes")
        return LaunchResult(128 + self._signal, reason=name)

    def _start_all(self, gates: Path) -> LaunchResult | None:
        """Start each process once what it waits for is healthy (an early one at once, its gate
        opened then), polling the health of the services not yet up and watching every process
        already started; ``None`` once all are started and every service answered."""
        pending = list(self.processes)
        unhealthy: dict[str, float] = {}  # started, health not answered yet -> when started
        closed: dict[str, Path] = {}  # early processes whose gate is still closed -> the gate
        while True:
            if (stop := self._interrupted()) is not None:
                return stop
            for proc in list(pending):
                earlier = self.processes[: self.processes.index(proc)]
                if proc.spec.waits_for is None and any(p in pending for p in earlier):
                    continue  # the default order: after every earlier one
                if not proc.spec.starts_early and not self._up(proc, pending, unhealthy):
                    continue
                if proc.spec.starts_early:
                    closed[proc.name] = gates / f"{proc.name}.open"
                    proc.start({GATE_ENV: str(closed[proc.name])})
                else:
                    proc.start()
                pending.remove(proc)
                if proc.spec.health_url:
                    unhealthy[proc.name] = time.monotonic()
            for name in [n for n in closed if self._up(self._by_name(n), pending, unhealthy)]:
                closed.pop(name).touch()  # the process's first request may go now
            if not pending and not unhealthy and not closed:
                return None
            if (failure := self._check_exits(before_healthy=unhealthy)) is not None:
                return failure
            for proc in [p for p in self.processes if p.name in unhealthy]:
                assert proc.spec.health_url is not None
                if poll_health(proc.spec.health_url, request_timeout_s=2.0) is not None:
                    del unhealthy[proc.name]
                elif time.monotonic() - unhealthy[proc.name] > self.health_timeout_s:
                    return self._failure(
                        proc,
                        f"did not answer {proc.spec.health_url} within {self.health_timeout_s:.0f} s "
                        f"(raise launch.health_timeout_s if it is just slow to start)",
                    )
            time.sleep(self.poll_s)

    def _up(self, proc: ManagedProcess, pending: list[ManagedProcess], unhealthy: dict[str, float]) -> bool:
        """Whether every service ``proc`` waits for is started and healthy."""
        return not any(w in pending or w.name in unhealthy for w in self._waits(proc))

    def _by_name(self, name: str) -> ManagedProcess:
        return next(p for p in self.processes if p.name == name)

    def _waits(self, proc: ManagedProcess) -> list[ManagedProcess]:
        """The services with a health URL that ``proc`` waits for."""
        names = proc.spec.waits_for
        earlier = self.processes[: self.processes.index(proc)]
        return [
            p
            for p in (earlier if names is None else self.processes)
            if p.spec.health_url and (names is None or p.name in names or p.spec.group in names)
        ]

    def _watch(self) -> LaunchResult:
        jobs = [p for p in self.processes if p.spec.kind == "job"]
        while True:
            if (stop := self._interrupted()) is not None:
                return stop
            if (failure := self._check_exits()) is not None:
                return failure
            if self.on_tick is not None:
                self.on_tick(self.statuses())
            if jobs and all(p.poll() == 0 for p in jobs):  # with no jobs: run until stopped
                return LaunchResult(0)
            time.sleep(self.poll_s)

    def _check_exits(self, before_healthy: dict[str, float] | None = None) -> LaunchResult | None:
        """The failure of the first process that ended the run by exiting, if any: one that
        exited before it was healthy (``before_healthy``: those not healthy yet), a job that
        exited non-zero, or a service that exited (the last of its group)."""
        for proc in self.processes:
            code = proc.poll()
            if code is None:
                continue
            if before_healthy is not None and proc.name in before_healthy:
                return self._failure(proc, f"exited with code {code} before it was healthy")
            if proc.spec.kind == "service":
                if proc.name in self._lost:
                    continue
                if self._others_of_group_run(proc):
                    self._lost.add(proc.name)
                    self.echo(
                        f"warning: {proc.name} exited with code {code}; the run goes on with the other "
                        f"{proc.spec.group} replicas (log: {proc.log_path})"
                    )
                    continue
                return self._failure(proc, f"exited with code {code} while the run needed it", code)
            if code != 0:
                return self._failure(proc, f"exited with code {code}", code)
        return None

    def _others_of_group_run(self, proc: ManagedProcess) -> bool:
        group = proc.spec.group
        return group is not None and any(
            p is not proc and p.spec.group == group and p.poll() is None for p in self.processes
        )

    def _failure(self, proc: ManagedProcess, what: str, exit_code: int | None = None) -> LaunchResult:
        reason = f"{proc.name} {what}"
        tail = proc.tail()
        self.echo(f"error: {reason}. Last lines of {proc.log_path}:\n{tail}" if tail else f"error: {reason}")
        return LaunchResult(1, failed=proc.name, reason=reason, failed_exit_code=exit_code)


def _check_waits(specs: list[ProcessSpec]) -> None:
    """Refuse a ``waits_for`` that names no service with a health URL (a typo would otherwise
    start the process before the server it calls)."""
    known = {s.name for s in specs if s.health_url} | {s.group for s in specs if s.health_url and s.group}
    for spec in specs:
        unknown = sorted(set(spec.waits_for or ()) - known)
        if unknown:
            raise ValueError(
                f"{spec.name} waits for {', '.join(unknown)}: no process of this launch has that name "
                f"(or group) and a health_url; the services are: {', '.join(sorted(known)) or 'none'}"
            )

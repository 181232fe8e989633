"""Start a list of processes in order, watch them, and stop all of them together.

The launcher knows nothing about RL: it gets ``ProcessSpec``s (inference, orchestrator, trainer,
later the teacher service) and a progress callback. Rules:

- processes start in the given order; one with a ``health_url`` must answer 200 before the next
  one starts (the orchestrator never talks to a server that is not up);
- the run succeeds when every ``job`` has exited 0; ``service``s are then stopped;
- the first process to fail (a job exiting non-zero, or a service exiting at all) fails the run:
  the launcher names it, prints the tail of its log and the resume hint, and stops the others;
  a service of a ``group`` (inference replicas) that exits is reported once, and fails the run
  only when it was the last of its group running;
- SIGINT / SIGTERM stop everything cleanly (exit 130 / 143).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prime_composer.health import wait_healthy
from prime_composer.launch.process import ManagedProcess, ProcessSpec


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
        try:
            result = self._start_all() or self._watch()
        finally:
            self.stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return result

    def stop_all(self) -> None:
        # Reverse start order: consumers (trainer, orchestrator) before the server they use.
        for proc in reversed(self.processes):
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

    def _start_all(self) -> LaunchResult | None:
        for proc in self.processes:
            if (stop := self._interrupted()) is not None:
                return stop
            proc.start()
            if proc.spec.health_url and (failure := self._wait_healthy(proc)) is not None:
                return failure
        return None

    def _wait_healthy(self, proc: ManagedProcess) -> LaunchResult | None:
        assert proc.spec.health_url is not None

        def give_up() -> str | None:
            if self._signal is not None:
                return "interrupted"
            code = proc.poll()
            return None if code is None else f"exited with code {code} before it was healthy"

        waited = wait_healthy(
            proc.spec.health_url, self.health_timeout_s, poll_s=self.poll_s, give_up=give_up
        )
        if waited.healthy:
            return None
        if (stop := self._interrupted()) is not None:
            return stop
        return self._failure(
            proc,
            waited.reason
            or f"did not answer {proc.spec.health_url} within {self.health_timeout_s:.0f} s "
            f"(raise launch.health_timeout_s if it is just slow to start)",
        )

    def _watch(self) -> LaunchResult:
        jobs = [p for p in self.processes if p.spec.kind == "job"]
        while True:
            if (stop := self._interrupted()) is not None:
                return stop
            for proc in self.processes:
                code = proc.poll()
                if code is None:
                    continue
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
            if self.on_tick is not None:
                self.on_tick(self.statuses())
            if jobs and all(p.poll() == 0 for p in jobs):  # with no jobs: run until stopped
                return LaunchResult(0)
            time.sleep(self.poll_s)

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

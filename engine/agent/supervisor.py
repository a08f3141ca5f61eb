"""Start engine worker processes, watch them, and restart a crashed one with exponential backoff.

Each worker moves through ``starting`` (process up, ``GET /health`` not yet 200) -> ``running`` -> on exit
``backoff`` (waiting ``delay`` seconds) -> ``starting`` again, or ``stopped`` after :meth:`Supervisor.stop`.
The delay after the n-th consecutive crash is ``min(backoff_base_s * 2**(n-1), backoff_max_s)``; a worker that
stays running for ``stable_after_s`` seconds has its crash count reset. A worker not healthy within
``startup_timeout_s`` is killed and counted as a crash. Like supervisord/systemd ``Restart=on-failure`` with
``RestartSec`` doubling, restarts never stop; the state shows the failures.

A running worker's health URL is probed every ``health_interval_s`` seconds; after ``unhealthy_after``
consecutive failed probes (not 200, e.g. 503 once its scheduler died, or no answer) the process is killed and
restarted like a crash (like a Kubernetes liveness probe's ``failureThreshold``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

log = logging.getLogger("kvfleet.agent")


@dataclass
class Managed:
    """One supervised process. ``command`` is the argv; ``health_url`` answers 200 once it serves;
    ``live_url`` (default: ``health_url``) is what the running process is probed with afterwards."""

    name: str
    command: list[str]
    health_url: str | None
    log_path: str
    env: dict[str, str] = field(default_factory=dict)
    live_url: str | None = None
    state: str = "starting"
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    healthy_at: float | None = None
    crashes: int = 0
    restarts: int = 0
    last_exit_code: int | None = None
    next_start_at: float = 0.0
    next_probe_at: float = 0.0
    failed_probes: int = 0

    def snapshot(self, now: float) -> dict:
        return {
            "name": self.name,
            "state": self.state,
            "pid": self.proc.pid if self.proc and self.proc.poll() is None else None,
            "restarts": self.restarts,
            "consecutive_crashes": self.crashes,
            "last_exit_code": self.last_exit_code,
            "restart_in_s": round(max(0.0, self.next_start_at - now), 1) if self.state == "backoff" else None,
            "log": self.log_path,
        }


@dataclass
class Event:
    """Something the agent reports: ``kind`` is started | healthy | crashed | replaced | stopped."""

    kind: str
    name: str
    detail: str = ""


def _probe(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


class Supervisor:
    def __init__(
        self,
        processes: list[Managed],
        *,
        backoff_base_s: float = 1.0,
        backoff_max_s: float = 60.0,
        stable_after_s: float = 60.0,
        startup_timeout_s: float = 600.0,
        health_interval_s: float = 5.0,
        unhealthy_after: int = 3,
        probe: Callable[[str], bool] = _probe,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.processes = {p.name: p for p in processes}
        self.backoff_base_s, self.backoff_max_s = backoff_base_s, backoff_max_s
        self.stable_after_s, self.startup_timeout_s = stable_after_s, startup_timeout_s
        self.health_interval_s, self.unhealthy_after = health_interval_s, unhealthy_after
        self.probe, self.clock = probe, clock

    def backoff(self, crashes: int) -> float:
        """Seconds to wait before the restart that follows the ``crashes``-th consecutive crash."""
        return min(self.backoff_base_s * 2 ** max(0, crashes - 1), self.backoff_max_s)

    def start_all(self) -> list[Event]:
        return [self._start(p) for p in self.processes.values()]

    def _start(self, p: Managed) -> Event:
        os.makedirs(os.path.dirname(p.log_path) or ".", exist_ok=True)
        with open(p.log_path, "ab") as out:
            p.proc = subprocess.Popen(
                p.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **p.env},
                start_new_session=True,  # its own process group: stop() reaches its children too
            )
        p.state, p.started_at, p.healthy_at = "starting", self.clock(), None
        return Event("started", p.name, f"pid {p.proc.pid}")

    def poll(self) -> list[Event]:
        """One supervision step: notice exits and health, start what is due; returns what happened."""
        events = []
        now = self.clock()
        for p in self.processes.values():
            if p.state in ("starting", "running") and p.proc.poll() is not None:
                events.append(self._crashed(p, f"exited with code {p.proc.returncode}", p.proc.returncode))
            elif p.state == "starting":
                if p.health_url is None or self.probe(p.health_url):
                    p.state, p.healthy_at = "running", now
                    p.next_probe_at, p.failed_probes = now + self.health_interval_s, 0
                    events.append(Event("healthy", p.name, f"after {now - p.started_at:.1f}s"))
                elif now - p.started_at > self.startup_timeout_s:
                    _terminate(p.proc, 5.0)
                    events.append(self._crashed(p, f"not healthy within {self.startup_timeout_s:.0f}s", None))
            elif p.state == "running":
                events += self._check_running(p, now)
            elif p.state == "backoff" and now >= p.next_start_at:
                p.restarts += 1
                events.append(self._start(p))
        return events

    def _check_running(self, p: Managed, now: float) -> list[Event]:
        if p.health_url is not None and now >= p.next_probe_at:
            p.next_probe_at = now + self.health_interval_s
            p.failed_probes = 0 if self.probe(p.live_url or p.health_url) else p.failed_probes + 1
            if p.failed_probes >= self.unhealthy_after:
                _terminate(p.proc, 5.0)
                why = f"health check failed {p.failed_probes} times in a row"
                return [self._crashed(p, why, p.proc.returncode)]
        if p.crashes and p.failed_probes == 0 and now - (p.healthy_at or now) >= self.stable_after_s:
            p.crashes = 0
        return []

    def _crashed(self, p: Managed, why: str, code: int | None) -> Event:
        p.crashes += 1
        p.last_exit_code = code
        delay = self.backoff(p.crashes)
        p.state, p.next_start_at = "backoff", self.clock() + delay
        return Event("crashed", p.name, f"{why}; restart #{p.restarts + 1} in {delay:.1f}s")

    def replace(self, name: str, command: list[str], why: str) -> Event:
        """Stop ``name`` (SIGTERM to its group, SIGKILL after 20 s) and start it again with ``command`` now;
        its crash count starts over. Later restarts use the new command."""
        p = self.processes[name]
        if p.proc is not None and p.proc.poll() is None:
            _terminate(p.proc, 20.0)
        p.command, p.crashes, p.failed_probes = command, 0, 0
        p.restarts += 1
        started = self._start(p)
        return Event("replaced", name, f"{why}; {started.detail}")

    def set_command(self, name: str, command: list[str]) -> None:
        """Later (crash) restarts of ``name`` use ``command``; the running process is left alone."""
        self.processes[name].command = command

    def running(self) -> list[str]:
        return [p.name for p in self.processes.values() if p.state == "running"]

    def snapshot(self) -> list[dict]:
        now = self.clock()
        return [p.snapshot(now) for p in self.processes.values()]

    def stop(self, timeout: float = 20.0) -> list[Event]:
        """SIGTERM every process group, SIGKILL what is left after ``timeout`` seconds."""
        live = [p for p in self.processes.values() if p.proc is not None and p.proc.poll() is None]
        for p in live:
            _signal_group(p.proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in live:
            try:
                p.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p.proc, signal.SIGKILL)
                p.proc.wait()
        for p in self.processes.values():
            p.state = "stopped"
        return [Event("stopped", p.name) for p in live]


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def _terminate(proc: subprocess.Popen, timeout: float) -> None:
    _signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
        proc.wait()

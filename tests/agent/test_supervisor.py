"""Supervisor against real processes: a crashing process is restarted with doubling delays; a process is
only 'running' once its health URL answers 200; a running process whose /health keeps answering 503 is
restarted; stop() ends the whole process group."""

from __future__ import annotations

import sys
import time

from engine.agent.supervisor import Managed, Supervisor
from engine.ports import free_port


def _gone(pid: int, timeout: float) -> bool:
    """True once ``pid`` no longer exists or is a zombie awaiting its new parent."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _run(sup: Supervisor, until, timeout: float) -> list[tuple[float, object]]:
    events, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline and not until(events):
        events += [(time.monotonic(), e) for e in sup.poll()]
        time.sleep(0.02)
    return events


def test_crashing_process_restarts_with_exponential_backoff(tmp_path):
    crash = Managed(
        "crasher", [sys.executable, "-c", "import sys; sys.exit(3)"], None, str(tmp_path / "c.log")
    )
    sup = Supervisor([crash], backoff_base_s=0.2, backoff_max_s=0.8, stable_after_s=60)
    assert [sup.backoff(n) for n in (1, 2, 3, 4, 5)] == [0.2, 0.4, 0.8, 0.8, 0.8]
    t0 = time.monotonic()
    sup.start_all()
    events = _run(sup, lambda ev: sum(e.kind == "started" for _, e in ev) >= 4, timeout=60)
    starts = [t0] + [t for t, e in events if e.kind == "started"]
    crashes = [(t, e) for t, e in events if e.kind == "crashed"]
    assert len(starts) >= 5 and len(crashes) >= 4
    assert all("exited with code 3" in e.detail for _, e in crashes)
    # each restart waits at least its backoff after the crash that caused it
    for (crashed_at, _), restarted_at, delay in zip(crashes, starts[1:], (0.2, 0.4, 0.8, 0.8), strict=False):
        assert restarted_at - crashed_at >= delay - 0.01
    assert crash.restarts == len(starts) - 1 and crash.last_exit_code == 3
    snap = sup.snapshot()[0]
    assert snap["restarts"] == crash.restarts and snap["consecutive_crashes"] >= 4
    sup.stop()


def test_running_only_after_health_answers_and_stop_ends_process_group(tmp_path):
    port = free_port()
    code = (
        "import http.server, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(tmp_path / 'child.pid')!r}, 'w').write(str(child.pid))\n"
        "time.sleep(0.5)\n"
        "handler = http.server.SimpleHTTPRequestHandler\n"
        f"http.server.HTTPServer(('127.0.0.1', {port}), handler).serve_forever()\n"
    )
    server = Managed(
        "web", [sys.executable, "-c", code], f"http://127.0.0.1:{port}/", str(tmp_path / "w.log")
    )
    sup = Supervisor([server], backoff_base_s=0.1)
    sup.start_all()
    assert sup.poll() == [] and server.state == "starting"  # not listening yet
    events = _run(sup, lambda ev: any(e.kind == "healthy" for _, e in ev), timeout=30)
    assert [e.kind for _, e in events] == ["healthy"]
    assert sup.running() == ["web"]
    child = int((tmp_path / "child.pid").read_text())
    sup.stop(timeout=10)
    assert server.proc.poll() is not None and server.state == "stopped"
    assert _gone(child, timeout=10)  # the worker's own child went with it (same process group)


def test_stable_worker_has_its_crash_count_reset(tmp_path):
    sleeper = Managed(
        "s", [sys.executable, "-c", "import time; time.sleep(30)"], None, str(tmp_path / "s.log")
    )
    sup = Supervisor([sleeper], stable_after_s=0.3)
    sup.start_all()
    sleeper.crashes = 2  # as if it had crashed twice before this start
    _run(sup, lambda ev: sleeper.state == "running" and sleeper.crashes == 0, timeout=10)
    assert sleeper.crashes == 0
    sup.stop()


def test_running_worker_answering_503_is_restarted_after_consecutive_failures(tmp_path, health_server):
    port, sick = free_port(), tmp_path / "sick"
    worker = Managed(
        "w", health_server(port, sick), f"http://127.0.0.1:{port}/health", str(tmp_path / "w.log")
    )
    sup = Supervisor([worker], backoff_base_s=0.2, health_interval_s=0.1, unhealthy_after=3)
    sup.start_all()
    _run(sup, lambda ev: worker.state == "running", timeout=30)
    first_pid = worker.proc.pid
    assert _run(sup, lambda ev: False, timeout=0.5) == []  # healthy: probed, nothing happens

    sick.touch()  # the process stays alive but /health now answers 503
    events = _run(sup, lambda ev: any(e.kind == "crashed" for _, e in ev), timeout=30)
    crashed = [e for _, e in events if e.kind == "crashed"]
    assert len(crashed) == 1 and "health check failed 3 times in a row" in crashed[0].detail
    assert worker.state == "backoff" and worker.crashes == 1 and worker.failed_probes == 3
    assert _gone(first_pid, timeout=10)  # the unhealthy process was killed

    sick.unlink()
    events = _run(sup, lambda ev: any(e.kind == "healthy" for _, e in ev), timeout=30)
    assert [e.kind for _, e in events] == ["started", "healthy"]
    assert worker.restarts == 1 and worker.proc.pid != first_pid and sup.running() == ["w"]
    sup.stop()

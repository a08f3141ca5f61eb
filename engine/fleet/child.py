"""A server process KVFleet starts for a fleet or a test (the Mooncake master, Prometheus): started in a
session of its own with its output in a log file, dead with the thread that started it, waited for until
it answers, stopped with SIGTERM then SIGKILL."""

from __future__ import annotations

import ctypes
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the starting thread's process dies (Linux prctl)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class ChildServer:
    """``process`` (None before :meth:`spawn`) and its ``log_path``; subclasses say how to start it and
    when it is ready."""

    process: subprocess.Popen | None = None
    log_path: str

    def spawn(self, cmd: list[str]) -> None:
        """Start ``cmd``, its stdout and stderr appended to ``log_path``."""
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent
            )

    def wait_ready(self, ready: Callable[[], bool], timeout: float, poll_s: float = 0.05) -> bool:
        """Poll ``ready()`` until it is true (True), the process exits or ``timeout`` seconds pass (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process is not None and self.process.poll() is None:
            if ready():
                return True
            time.sleep(poll_s)
        return False

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the log ("(no log)" when it cannot be read)."""
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL the process (a crash); no-op when not running."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def terminate(self, timeout: float) -> None:
        """SIGTERM (SIGKILL after ``timeout`` seconds); no-op when not running."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

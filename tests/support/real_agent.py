"""Real ``kvfleet-agent run`` processes in tests, and the polling they need.

``agent_process(control_plane, spec, token, log)``: the agent started as a user would (its token through the
environment, never argv), stopped with SIGTERM on exit (it stops its workers; SIGKILL after 90 s).
``poll(what, fetch, deadline_s)``: ``fetch()``'s first truthy answer, polled every 0.5 s; fails the test
naming ``what`` past the deadline (generous: real workers start slowly on a loaded 2-core machine).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path


def poll(what: str, fetch: Callable, deadline_s: float = 300.0):
    deadline = time.monotonic() + deadline_s
    while True:
        got = fetch()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@contextlib.contextmanager
def agent_process(
    control_plane: str, spec: Path, token: str, log: Path, **env: str
) -> Iterator[subprocess.Popen]:
    agent = subprocess.Popen(
        [sys.executable, "-m", "engine.agent", "run", "--control-plane", control_plane, "--spec", str(spec)],
        env={**os.environ, "KVFLEET_AGENT_TOKEN": token, **env},
        stdout=subprocess.DEVNULL,
        stderr=log.open("wb"),
    )
    try:
        yield agent
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(90)
        except subprocess.TimeoutExpired:
            agent.kill()
